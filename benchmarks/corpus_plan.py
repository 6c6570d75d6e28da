"""The planning figures of docs/corpus.md, computed from the code rather than written by hand.

* What a ``keep="stats"`` run writes: two real runs of the zoo's minigpt (16 and 32 texts) give
  the bytes per head of a shard record and of the run's statistics files, and the bytes per text
  (manifest and shard record), by difference.
* What it holds while it runs: the per-query terms of one attention (the streamed path's
  :class:`~probe.analysis.focus.streamed.reader.RowTerms`, its tensors' bytes summed for a given shape;
  on a CPU they are reduced when the attention closes, on a GPU every attention's wait for the end
  of the forward) and one row block of weights (:func:`probe.capture.consumers.blocks.block_bytes`).
* What a pattern costs: 4·T² bytes per head per text (float32), 2·T² with ``--dtype float16``.

    python benchmarks/corpus_plan.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KiB, MiB, GiB = 2**10, 2**20, 2**30


def _sizes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def written() -> dict[str, float]:
    """Bytes per head of a shard record and of the statistics files, and bytes per text."""
    sys.path.insert(0, str(ROOT))
    import models
    import probe

    model = models.load("minigpt")
    sizes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (16, 32):
            texts = [f"attention lets tokens read {'a' * (i % 5)}." for i in range(n)]
            probe.run_corpus(
                model, texts, Path(tmp) / str(n), batch_size=8, keep="stats", examples=False, progress=False
            )
            sizes[n] = _sizes(Path(tmp) / str(n))
        stats = probe.run_corpus(
            model, texts, Path(tmp) / "32", keep="stats", examples=False, progress=False
        ).head_stats()
        heads = len(stats.table)
    shard = {  # the shard records (the per-text store's Parquet files: docs/explore.md, Scale)
        n: sum(v for k, v in s.items() if k.startswith("shards") and not k.endswith(".parquet"))
        for n, s in sizes.items()
    }
    per_text = (shard[32] + sizes[32]["manifest.json"] - shard[16] - sizes[16]["manifest.json"]) / 16
    shard_text = (shard[32] - shard[16]) / 16
    once = sum(sizes[32][k] for k in ("stats.json", "head_stats.json", "head_stats.csv"))
    return {
        "shard_per_head": (shard[16] - 16 * shard_text) / heads,
        "files_per_head": once / heads,
        "per_text": per_text,
    }


def held(layers: int, heads: int, T: int, device: str = "cpu") -> float:
    """Bytes the streamed statistics hold at most for one text: the per-query terms of a
    self-attention :class:`RowTerms` of ``[1, heads, T, T]`` (token ids known, words split), once
    on a CPU (reduced when the attention closes), times ``layers`` on a GPU (kept there until the
    forward ends), plus one row block of weights."""
    import torch

    from probe.analysis.focus.definitions.tokens import Side
    from probe.analysis.focus.streamed.reader import RowTerms
    from probe.capture.consumers.blocks import block_bytes

    def side() -> Side:
        real = torch.ones(1, 8, dtype=torch.bool)
        return Side(
            real=real,
            ids=torch.zeros(1, 8, dtype=torch.long),
            word=torch.tensor([[0, 0, 1, 2, 3, 4, 5, 6]]),
            special=~real,
            punct=~real,
            first=torch.zeros(1, dtype=torch.long),
            end=torch.full((1,), 7),
            n_words=7,
        )

    small = RowTerms(side(), side(), (1, heads, 8, 8), self_attn=True)
    per_query = _nbytes(small.t) / (heads * 8)  # every term is [B, H, Q] (or [B, Q] / [B, H, Q, 3])
    per_key = (small.recv.nbytes + small.recv_first.nbytes) / (heads * 8)
    attentions = layers if device == "cuda" else 1
    return attentions * heads * T * (per_query + per_key) + block_bytes(device, heads * T)


def _nbytes(t) -> int:
    import torch

    total = 0
    for v in vars(t).values():
        if isinstance(v, torch.Tensor):
            total += v.nbytes
        elif isinstance(v, dict):
            total += sum(x.nbytes for x in v.values())
    return total


def _h(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def main() -> None:
    w = written()
    print(
        f"keep='stats' writes: {w['shard_per_head'] / 1e3:.1f} KB per head per shard record, "
        f"{w['files_per_head'] / 1e3:.1f} KB per head once (stats.json, head_stats.json/.csv), "
        f"about {round(w['per_text'], -1):.0f} B per text"  # tens: the last digits move with float text
    )
    print(
        "held while a text runs (keep='stats'): one attention's terms (a GPU: every attention's) "
        "+ one row block"
    )
    for name, L, H, T in (
        ("GPT-2 small", 12, 12, 2048),
        ("GPT-2 small", 12, 12, 16384),
        ("7B", 32, 32, 2048),
        ("7B", 32, 32, 16384),
    ):
        print(
            f"  {name}, T = {T}: CPU {_h(held(L, H, T))}, GPU {_h(held(L, H, T, 'cuda'))} "
            f"(every float32 pattern whole: {_h(4 * L * H * T * T)})"
        )


if __name__ == "__main__":
    main()
