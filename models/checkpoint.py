"""Where zoo weights live, and how they are written and read.

A checkpoint is one safetensors file: the model's `state_dict()` plus string metadata, every value
JSON-encoded:

    format      1, bumped when the layout of a checkpoint changes
    model       the zoo name, e.g. "minigpt"
    config      the architecture (the model module's `Config` dataclass as a dict)
    recipe      the training hyper-parameters (seed, lr, steps, ...)
    final_loss  the training loss at the last step (null for the untrained single_head)
    steps       optimizer steps taken
    train_seconds  wall-clock training time
    torch, threads the torch version and torch.get_num_threads() of the run: the recipes are
                bit-for-bit deterministic for a given machine, torch build and thread count,
                while other thread counts or CPUs round differently (same quality, other bits)

Small checkpoints ship in the package (`models/checkpoints/NAME.safetensors`); the rest are
trained on first use into the cache directory: `$PROBE_CACHE_DIR`, or `~/.cache/probe`, under
`models/`.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

FORMAT = 1
SHIPPED_DIR = Path(__file__).parent / "checkpoints"


@dataclass
class TrainStats:
    """What a training recipe reports next to the weights it produced."""

    final_loss: float | None
    steps: int
    seconds: float
    recipe: dict[str, Any]
    losses: list[float] = field(default_factory=list)  # one per step, not saved to the file


def cache_dir() -> Path:
    """The user's probe cache: `$PROBE_CACHE_DIR` if set, else `~/.cache/probe`."""
    env = os.environ.get("PROBE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "probe"


def shipped_path(name: str) -> Path:
    """The checkpoint that ships inside the package (it may not exist, e.g. the translator's)."""
    return SHIPPED_DIR / f"{name}.safetensors"


def cached_path(name: str, root: str | os.PathLike | None = None) -> Path:
    """The checkpoint trained on first use: `<cache_dir>/models/NAME.safetensors`."""
    return Path(root if root is not None else cache_dir()) / "models" / f"{name}.safetensors"


def save(
    model: torch.nn.Module, path: str | os.PathLike, *, name: str, config: Any, stats: TrainStats
) -> Path:
    """Write `model`'s weights and metadata to `path` atomically; returns the path.

    The file is written next to its destination and moved into place with `os.replace`, so an
    interrupted run leaves either the old checkpoint or none, never half a file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    metadata = {
        "format": FORMAT,
        "model": name,
        "config": config if isinstance(config, dict) else vars(config),
        "recipe": stats.recipe,
        "final_loss": stats.final_loss,
        "steps": stats.steps,
        "train_seconds": round(stats.seconds, 3),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={k: json.dumps(v) for k, v in metadata.items()})
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a checkpoint is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The decoded metadata of a checkpoint (see the module docstring for the keys)."""
    with safe_open(str(path), framework="pt") as f:
        raw = f.metadata() or {}
    return {k: json.loads(v) for k, v in raw.items()}


def read(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state_dict, metadata) of a checkpoint."""
    return load_file(str(path)), read_metadata(path)
