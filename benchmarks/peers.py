"""Benchmark: probe against the other ways to get attention patterns out of a GPT-2, in one process.

A GPT-2-small-shaped Hugging Face ``GPT2LMHeadModel`` (12 layers, 12 heads, d_model 768, vocab
50257, random weights, seeded), batch 1, T = 128, 512, 1024, the same weights in every mode:

* ``hf-sdpa``: the plain forward on SDPA under ``torch.no_grad()`` (the baseline; no patterns);
* ``hf-eager``: a second model object on eager attention, ``output_attentions=True``;
* ``tl``: TransformerLens's ``TransformerBridge`` over a third object, ``run_with_cache`` (every
  hook, as people call it);
* ``tl-patterns``: the same with ``names_filter`` keeping only ``hook_pattern``;
* ``probe``: ``probe.capture(model, ids)`` on the SDPA model, the cache kept in memory.

Every HF object has ``use_cache=False`` (no KV cache) and runs under ``torch.no_grad()``. The
modes are interleaved round-robin (the machine's speed drifts, so every repeat times all of them
back to back); the table has medians, ratios to ``hf-sdpa`` and ``hf-eager``, and each mode's
peak RSS, measured in a fresh child process after a tiny warm-up run (helpers from
``capture.py``). Before timing, the patterns of all modes are checked to agree.

    python benchmarks/peers.py                                   # the README table
    python benchmarks/peers.py --repeats 1 --lengths 128 --no-rss   # a quick check
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights, local tokenizer: never the Hub

import torch  # noqa: E402
import transformers  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from capture import inputs  # noqa: E402

import probe  # noqa: E402

try:
    from transformer_lens import TransformerBridge
except ImportError:  # the table then says so; everything else still runs
    TransformerBridge = None

MODES = ("hf-sdpa", "hf-eager", "tl", "tl-patterns", "probe")
BUILD = {"hf-sdpa": "sdpa", "probe": "sdpa", "hf-eager": "eager", "tl": "tl", "tl-patterns": "tl"}
VOCAB = 50257


def gpt2(attn: str = "sdpa", like: transformers.GPT2LMHeadModel | None = None, n_positions: int = 1024):
    """GPT-2-small-shaped, random, seeded; ``like`` shares that model's weight tensors."""
    # each object gets its own config: booting TransformerLens edits the config it is handed
    cfg = transformers.GPT2Config(
        n_layer=12,
        n_head=12,
        n_embd=768,
        n_positions=n_positions,
        vocab_size=VOCAB,
        use_cache=False,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    if like is not None:
        model.load_state_dict(like.state_dict(), assign=True)  # the same tensors, no copy
    return model


def tokenizer(folder: str):
    """A tiny byte-level BPE, saved to and loaded from ``folder`` (none may be downloaded).

    Booting reloads the tokenizer from that folder (to switch BOS on), so it must outlive the
    boot. Only ``run_with_cache`` on token ids is timed, so its vocabulary does not matter.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(["attention lets tokens read from each other."], trainer)
    eot = "<|endoftext|>"
    tok = transformers.GPT2TokenizerFast(tokenizer_object=bpe, bos_token=eot, eos_token=eot, unk_token=eot)
    tok.save_pretrained(folder)
    return transformers.AutoTokenizer.from_pretrained(folder)


def build(kind: str, base: transformers.GPT2LMHeadModel | None = None):
    """The model a mode runs: ``sdpa``, ``eager`` or ``tl`` (a bridge), weights shared with ``base``."""
    base = base if base is not None else gpt2("sdpa")
    if kind == "sdpa":
        return base
    if kind == "eager":
        return gpt2("eager", like=base, n_positions=base.config.n_positions)
    if TransformerBridge is None:
        raise RuntimeError("transformer-lens is not installed")
    hf = gpt2(
        "sdpa", like=base, n_positions=base.config.n_positions
    )  # the bridge switches it to eager and wraps its modules
    with tempfile.TemporaryDirectory() as d:
        bridge = TransformerBridge.boot_transformers(d, hf_model=hf, tokenizer=tokenizer(d), device="cpu")
    return bridge.eval()


def is_pattern(name: str) -> bool:
    return name.endswith("hook_pattern")


def run(mode: str, model, ids: torch.Tensor):
    """Run ``mode`` once; returns the patterns [layer][batch, head, q, k] it yields (or None)."""
    with torch.no_grad():
        if mode == "hf-sdpa":
            model(input_ids=ids)
            return None
        if mode == "hf-eager":
            return model(input_ids=ids, output_attentions=True).attentions
        if mode == "tl":
            _, cache = model.run_with_cache(ids)
        elif mode == "tl-patterns":
            _, cache = model.run_with_cache(ids, names_filter=is_pattern)
        else:
            cache = probe.capture(model, ids)
            return [cache.pattern("decoder", i) for i in range(12)]
    return [cache[f"blocks.{i}.attn.hook_pattern"] for i in range(12)]


def check(models: dict, T: int = 32) -> float:
    """Largest difference between the patterns of the modes (they must compute the same thing)."""
    ids = inputs("gpt2", T)
    ref = run("hf-eager", models["eager"], ids)
    worst = 0.0
    for mode in ("tl", "tl-patterns", "probe"):
        if BUILD[mode] in models:
            got = run(mode, models[BUILD[mode]], ids)
            worst = max(worst, max((a - b).abs().max().item() for a, b in zip(got, ref, strict=True)))
    if worst > 1e-4:
        raise AssertionError(f"the modes disagree on the patterns: max |difference| {worst:.2e}")
    return worst


def child_peak_rss(mode: str, T: int) -> int:
    """Peak RSS (bytes) while a fresh process runs ``mode`` once on an already built model."""
    code = (
        "import sys; sys.path.insert(0, %r); import peers as b, capture as c, gc;"
        f"b.torch.set_num_threads({torch.get_num_threads()});"
        "m = b.build(b.BUILD[%r]); ids = b.inputs('gpt2', %d);"
        # a tiny run first, so lazy imports and one-time set-up are not counted
        "b.run(%r, m, b.inputs('gpt2', 8)); gc.collect();"
        "c._reset_hwm(); r = b.run(%r, m, ids); print(c._vm_hwm())"
    ) % (str(HERE), mode, T, mode, mode)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS child processes")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    base = gpt2("sdpa")
    models = {"sdpa": base, "eager": build("eager", base)}
    modes = list(MODES)
    if TransformerBridge is None:
        modes = [m for m in modes if BUILD[m] != "tl"]
        print("transformer-lens is not installed: its rows are left out")
    else:
        models["tl"] = build("tl", base)
    tl_version = "-" if TransformerBridge is None else importlib.metadata.version("transformer-lens")
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, transformer-lens "
        f"{tl_version}, probe {probe.__version__}; {torch.get_num_threads()} threads, "
        f"{args.repeats} interleaved repeats, medians"
    )
    print(f"patterns agree across modes: max |difference| {check(models):.1e}\n")
    print("| mode | T | median s | × HF sdpa | × HF eager | peak RSS MB |")
    print("|---|---|---|---|---|---|")
    for T in args.lengths:
        ids = inputs("gpt2", T)
        for mode in modes:  # warm-up
            run(mode, models[BUILD[mode]], ids)
        times: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(args.repeats):
            k = r % len(modes)
            for mode in modes[k:] + modes[:k]:
                gc.collect()
                t0 = time.perf_counter()
                out = run(mode, models[BUILD[mode]], ids)
                times[mode].append(time.perf_counter() - t0)
                del out
        med = {m: statistics.median(v) for m, v in times.items()}
        for mode in modes:
            rss = "-" if args.no_rss else f"{child_peak_rss(mode, T) / 2**20:.0f}"
            print(
                f"| {mode} | {T} | {med[mode]:.3f} | {med[mode] / med['hf-sdpa']:.2f} | "
                f"{med[mode] / med['hf-eager']:.2f} | {rss} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
