"""Corpus runs: many texts, bounded memory, resumable, sharded across ``torchrun`` ranks."""

from probe.corpus.read import Corpus, open_corpus
from probe.corpus.run import CorpusFailed, run_corpus

__all__ = ["run_corpus", "open_corpus", "Corpus", "CorpusFailed"]
