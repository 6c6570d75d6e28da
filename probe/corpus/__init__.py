"""Corpus runs: many texts, bounded memory, resumable, sharded across ``torchrun`` ranks.

``run.py`` runs the whole (``probe.run_corpus``) over the texts of ``texts.py`` or the pictures of
``pictures.py``, storing what ``keep.py`` says; ``shards.py`` captures and records one shard,
``dist.py`` talks to ``torchrun``; ``store.py``, ``examples.py`` and ``showcase.py`` write the
per-text store and each head's examples, ``queries.py`` reads the store with SQL and ``read.py``
opens a finished run (``probe.open_corpus``).
"""

from probe.corpus.read import Corpus, open_corpus
from probe.corpus.run import CorpusFailed, run_corpus

__all__ = ["run_corpus", "open_corpus", "Corpus", "CorpusFailed"]
