"""probe: see what attention inside a transformer really does.

The public API is small and flat::

    import probe
    cache = probe.capture(model, "attention lets tokens read context.")
    cache.pattern("decoder", 0)          # [batch, head, query, key]
    cache.save("run.safetensors")
    cache = probe.load("run.safetensors")  # lazy, memory-mapped
"""

# probe.report is a callable module: probe.report(cache, "out/") writes out/index.html, and its
# submodules (probe.report.html, probe.report.sections, ...) import as usual.
from probe import report  # noqa: E402
from probe.analysis.alignment import Alignment, WordTimestamps, align, word_timestamps  # noqa: E402
from probe.analysis.artifacts import Artifacts, artifacts  # noqa: E402
from probe.analysis.causal import CausalReport, check_causal  # noqa: E402
from probe.analysis.compare import Comparison, compare  # noqa: E402
from probe.analysis.focus import HeadStats, head_stats, induction_scores, retrieval_scores  # noqa: E402
from probe.analysis.generation import Lookback, lookback  # noqa: E402
from probe.analysis.maps import attention_map  # noqa: E402
from probe.analysis.pointing import Pointing, pointing  # noqa: E402
from probe.analysis.residual import budget, logit_lens, residual  # noqa: E402
from probe.cache import Cache, load  # noqa: E402
from probe.capture import Trace, trace  # noqa: E402
from probe.corpus import Corpus, open_corpus, run_corpus  # noqa: E402
from probe.entry import capture  # noqa: E402  (keep="stats" too)
from probe.errors import ProbeError  # noqa: E402
from probe.generation import Generation, generate  # noqa: E402
from probe.intervene import (  # noqa: E402
    Ablation,
    Composition,
    HeadImportance,
    HeadWrites,
    Intervention,
    Knockout,
    Patching,
    TokenMixing,
    ablate,
    alti,
    composition,
    contributions,
    head_importance,
    head_writes,
    intervene,
    knockout,
    patch,
    value_zeroing,
)
from probe.intervene.circuit import Circuit, circuit  # noqa: E402
from probe.version import __version__

__all__ = ["capture", "trace", "Trace", "load", "Cache", "ProbeError", "report", "plot", "__version__"]
__all__ += [
    "check_causal",
    "CausalReport",
    "head_stats",
    "HeadStats",
    "induction_scores",
    "retrieval_scores",
    "residual",
    "logit_lens",
    "budget",
    "align",
    "Alignment",
    "compare",
    "Comparison",
]
__all__ += ["run_corpus", "open_corpus", "Corpus"]
__all__ += ["generate", "Generation"]
__all__ += ["ablate", "Ablation", "patch", "Patching", "head_importance", "HeadImportance"]
__all__ += ["knockout", "Knockout", "intervene", "Intervention"]
__all__ += ["word_timestamps", "WordTimestamps"]
__all__ += ["attention_map", "pointing", "Pointing", "artifacts", "Artifacts"]
__all__ += ["lookback", "Lookback"]
__all__ += ["head_writes", "HeadWrites", "composition", "Composition"]
__all__ += ["circuit", "Circuit"]
__all__ += ["contributions", "alti", "value_zeroing", "TokenMixing"]


def __getattr__(name: str):
    # probe.plot pulls in matplotlib and seaborn (seconds to import): load it on first use only.
    if name == "plot":
        import importlib

        return importlib.import_module("probe.plot")
    raise AttributeError(f"module 'probe' has no attribute {name!r}")
