"""A corpus run's examples: each head's top and bottom texts by chosen statistics, shown without their
patterns (``shards/NNNNN.examples.parquet``).

After every shard's statistics are written, :func:`select` reads the heads files shard by shard
and keeps, for every head and each statistic of ``examples["stats"]``, the ``k`` texts with the
largest and the ``k`` with the smallest value (NaN left out; ties by text index: the order of
``corpus.top``), so memory holds heads x statistics x 2k candidates, whatever the corpus size.
Each rank then captures again, with whole patterns, only the chosen texts of its shards (only
the layers it needs, in captures that hold at most :data:`EXAMPLE_BYTES` of patterns: long
texts go a few layers, or one text and layer, at a time), and writes per shard one row per
(head, statistic, direction, text):
``text``, ``stack``, ``layer``, ``head``, ``kind``, ``stat``, ``direction`` (``"top"``,
``"bottom"``), ``rank`` (1 = the most extreme), ``value`` (the stored statistic) and what
:class:`~probe.corpus.examples.Example` holds (``positions``, ``terms``, ``keys``, ``weights``,
``targets``). The file marks the shard's examples done (written atomically; a rerun skips it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from probe import interrupt
from probe.corpus.examples import KEYS, POSITIONS, Example, LayerExamples
from probe.corpus.queries import EXAMPLES, check_stat
from probe.corpus.store import HEADS, TEXTS, pyarrow, shard_file, write_parquet
from probe.entry import capture
from probe.errors import ProbeError

# a statistic per role rule (probe.analysis.focus.definitions.table.ROLE_RULES), and the induction score
STATS = (
    "induction_score",
    "induction_prefix",
    "dup_prefix",
    "prev",
    "next",
    "self",
    "norm_entropy",
    "first",
    "pos_frac",
    "local",
)
K = 20


def examples_spec(examples: Any) -> dict | None:
    """``examples`` checked: ``None``/``False`` (none), ``True`` (the defaults), or a dict of
    ``stats`` (statistics), ``k`` (texts per head and direction), ``positions``, ``keys``."""
    if examples is None or examples is False:
        return None
    spec = {"stats": list(STATS), "k": K, "positions": POSITIONS, "keys": KEYS}
    if examples is not True:
        if not isinstance(examples, dict) or not set(examples) <= set(spec):
            raise ProbeError(f"examples={examples!r}: give True, False or a dict with keys {sorted(spec)}")
        spec.update(examples)
    spec["stats"] = [
        check_stat(s) for s in ([spec["stats"]] if isinstance(spec["stats"], str) else spec["stats"])
    ]
    for name in ("k", "positions", "keys"):
        if not isinstance(spec[name], int) or isinstance(spec[name], bool) or spec[name] < 1:
            raise ProbeError(f"examples[{name!r}]={spec[name]!r}: give a positive integer")
    return spec


def _best(values: np.ndarray, texts: np.ndarray, k: int, top: bool) -> np.ndarray:
    """Indices of the ``k`` best finite ``values`` (largest or smallest; ties by text)."""
    ok = np.flatnonzero(np.isfinite(values))
    v = values[ok]
    order = np.lexsort((texts[ok], -v if top else v))[:k]
    return ok[order]


def select(out: Path, n_shards: int, spec: dict) -> dict[tuple, tuple[np.ndarray, np.ndarray]]:
    """``(stack, layer, kind, head, stat, direction) -> (texts, values)``: each head's ``k`` most
    extreme texts by each statistic, best first, read from the heads files one row group at a time."""
    import pyarrow.parquet as pq

    best: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    for i in range(n_shards):
        f = pq.ParquetFile(shard_file(out, i, HEADS))
        for g in range(f.num_row_groups):
            t = f.read_row_group(g, columns=["text", "stack", "layer", "kind", "head", *spec["stats"]])
            if not t.num_rows:
                continue
            where = (t["stack"][0].as_py(), int(t["layer"][0].as_py()), t["kind"][0].as_py())
            text, head = t["text"].to_numpy(), t["head"].to_numpy()
            for h in np.unique(head):
                rows = head == h
                for stat in spec["stats"]:
                    v = t[stat].to_numpy(zero_copy_only=False)[rows].astype(np.float32)
                    for direction in ("top", "bottom"):
                        key = (*where, int(h), stat, direction)
                        old_t, old_v = best.get(key, (np.empty(0, np.int64), np.empty(0, np.float32)))
                        tt = np.concatenate([old_t, text[rows]])
                        vv = np.concatenate([old_v, v])
                        keep = _best(vv, tt, spec["k"], direction == "top")
                        best[key] = (tt[keep], vv[keep])
    return best


def wanted_by_shard(best: dict, shard_size: int) -> dict[int, list[tuple]]:
    """The selection grouped by shard: ``shard -> [(text, key, rank, value), ...]``."""
    out: dict[int, list[tuple]] = {}
    for key, (texts, values) in best.items():
        for rank, (t, v) in enumerate(zip(texts.tolist(), values.tolist(), strict=True), 1):
            out.setdefault(t // shard_size, []).append((t, key, rank, v))
    return out


EXAMPLE_BYTES = 2**30  # the whole patterns one capture of the examples pass holds, at most


def run_examples(
    model, tokenizer, texts: list[str], out: Path, cfg: dict, mine: list[int], progress: bool = False
) -> None:
    """Write the examples of the shards ``mine`` (those without their file yet); see the module.
    ``progress``: a bar over the texts captured again."""
    from tqdm.auto import tqdm

    spec = cfg["examples"]
    todo = [i for i in mine if not shard_file(out, i, EXAMPLES).is_file()]
    if not todo:
        return
    n_shards = -(-cfg["n_texts"] // cfg["shard_size"])
    best = select(out, n_shards, spec)
    heads: dict[tuple, set[int]] = {}  # (stack, layer, kind) -> its heads
    for stack, layer, kind, head, *_ in best:
        heads.setdefault((stack, layer, kind), set()).add(head)
    n_heads = min((len(h) for h in heads.values()), default=1)  # every attention has these
    wanted = wanted_by_shard(best, cfg["shard_size"])
    total = sum(len({w[0] for w in wanted.get(i, [])}) for i in todo)
    with tqdm(total=total, desc="examples", unit="text", disable=not progress) as bar:
        for i in todo:
            rows = shard_rows(
                model,
                tokenizer,
                texts,
                wanted.get(i, []),
                cfg["batch_size"],
                spec,
                bar,
                _lengths(out, i),
                n_heads,
            )
            write_parquet(shard_file(out, i, EXAMPLES), [rows], empty=rows)
            interrupt.check()


def _lengths(out: Path, shard: int) -> dict[int, int]:
    """Each text of a shard -> its token count (from the shard's texts file)."""
    t = pyarrow().parquet.read_table(shard_file(out, shard, TEXTS), columns=["text", "n_tokens"])
    return dict(zip(t["text"].to_pylist(), t["n_tokens"].to_pylist(), strict=True))


Capture = tuple[list[int], list[int], list[int]]  # texts, layers, heads


def captures(
    order: list[int],
    need: dict[int, dict[int, set[int]]],
    lengths: dict[int, int],
    n_heads: int,
    batch_size: int,
    budget: int = EXAMPLE_BYTES,
) -> list[Capture]:
    """``[(texts, layers, heads)]``: the captures of the examples pass (``need``: each text's
    layers and, per layer, the heads its examples read; ``n_heads``: the heads every attention
    has), each holding at most ``budget`` bytes of float32 patterns, ``len(texts) · T² ·
    len(heads) · 4`` a layer for texts padded to the longest ``T``. Texts in ``order`` (by
    length) join a batch while its one-layer capture fits; a batch's layers are split while their
    patterns fit. ``heads``: the union of what the capture's texts read in its layers (the
    patterns of no other head are kept). A single text and layer past the budget is one capture
    of its own (its example is read from its patterns)."""

    def heads(batch: list[int], layers: list[int]) -> list[int]:
        return sorted({h for t in batch for layer in layers for h in need[t].get(layer, ())})

    def held(batch: list[int], layers: list[int]) -> int:
        T = max(lengths.get(t, 0) for t in batch)
        return len(batch) * T * T * 4 * len(heads(batch, layers)) * len(layers)

    out: list[Capture] = []
    j = 0
    while j < len(order):
        batch = [order[j]]
        j += 1
        while j < len(order) and len(batch) < batch_size:
            more = [*batch, order[j]]
            if any(held(more, [layer]) > budget for layer in {x for t in more for x in need[t]}):
                break
            batch.append(order[j])
            j += 1
        chunk: list[int] = []
        for layer in sorted({x for t in batch for x in need[t]}):
            if chunk and held(batch, [*chunk, layer]) > budget:
                out.append((batch, chunk, heads(batch, chunk)))
                chunk = []
            chunk.append(layer)
        out.append((batch, chunk, heads(batch, chunk)))
    return out


def shard_rows(
    model,
    tokenizer,
    texts: list[str],
    wanted: list[tuple],
    batch_size: int,
    spec: dict,
    bar: Any = None,
    lengths: dict[int, int] | None = None,
    n_heads: int = 1,
) -> Any:
    """The examples table of one shard's ``wanted`` ``(text, key, rank, value)`` entries: their texts
    captured again (by length, ``batch_size`` at a time, the layers and heads they need), in
    captures of bounded memory (:func:`captures`; ``lengths``: each text's tokens, else its
    characters; ``n_heads``: the heads every attention of the model has)."""
    by_text: dict[int, list[tuple]] = {}
    need: dict[int, dict[int, set[int]]] = {}
    for w in wanted:
        by_text.setdefault(w[0], []).append(w)
        need.setdefault(w[0], {}).setdefault(w[1][1], set()).add(w[1][3])
    order = sorted(by_text, key=lambda t: (len(texts[t]), t))
    lengths = lengths or {t: len(texts[t]) for t in order}
    done: dict[tuple[int, int], dict] = {}
    plan = captures(order, need, lengths, n_heads, batch_size, EXAMPLE_BYTES)
    for n, (batch, layers, heads) in enumerate(plan):
        # every attention has the heads selected (a model whose stacks differ: all of them kept)
        pick = heads if heads and max(heads) < n_heads else None
        cache = capture(model, [texts[t] for t in batch], tokenizer=tokenizer, layers=layers, heads=pick)
        seen: dict[tuple, LayerExamples] = {}
        for row, t in enumerate(batch):
            for i, (_, (stack, layer, kind, head, stat, direction), rank, value) in enumerate(by_text[t]):
                if layer not in layers:
                    continue
                where = (stack, layer, kind)
                if where not in seen:
                    seen[where] = LayerExamples(cache, stack, layer, kind)
                try:
                    ex = seen[where].example(row, head, stat, direction, spec["positions"], spec["keys"])
                except ProbeError:  # a statistic with no per-query term here: its value, no positions
                    ex = Example([], [], [], [], [])
                done[(t, i)] = {
                    "text": t,
                    "stack": stack,
                    "layer": layer,
                    "head": head,
                    "kind": kind,
                    "stat": stat,
                    "direction": direction,
                    "rank": rank,
                    "value": value,
                    **vars(ex),
                }
        del cache, seen
        if bar is not None and (n + 1 == len(plan) or plan[n + 1][0] is not batch):
            bar.update(len(batch))
    return examples_table([done[(t, i)] for t in order for i in range(len(by_text[t]))])


def capture_text(model, tokenizer, source: str, layers: list[int] | None = None) -> Any:
    """One text captured again with whole patterns (``layers``: only those), as a run's examples are."""
    return capture(model, [source], tokenizer=tokenizer, layers=layers)


def example_now(
    model, tokenizer, source: str, where: tuple, head: int, stat: str, direction: str, spec: dict
) -> Example:
    """The example of one text (``source``) for head ``head`` of ``where`` = ``(stack, layer, kind)``,
    captured now (what :func:`run_examples` keeps, for a statistic or text the run did not keep)."""
    stack, layer, kind = where
    cache = capture_text(model, tokenizer, source, [layer])
    return LayerExamples(cache, stack, layer, kind).example(
        0, head, stat, direction, spec.get("positions", POSITIONS), spec.get("keys", KEYS)
    )


def examples_table(records: list[dict]) -> Any:
    """The pyarrow table of example records (the columns of the module docstring), sorted by head."""
    pa = pyarrow()
    records.sort(
        key=lambda r: (r["stack"], r["layer"], r["kind"], r["head"], r["stat"], r["direction"], r["rank"])
    )
    ints, floats = pa.list_(pa.int32()), pa.list_(pa.float32())
    cols = {
        "text": pa.int64(), "stack": pa.string(), "layer": pa.int16(), "head": pa.int16(),
        "kind": pa.string(), "stat": pa.string(), "direction": pa.string(), "rank": pa.int16(),
        "value": pa.float32(), "positions": ints, "terms": floats, "keys": pa.list_(ints),
        "weights": pa.list_(floats), "targets": pa.list_(ints),
    }  # fmt: skip
    return pa.table({c: pa.array([r[c] for r in records], t) for c, t in cols.items()})


__all__ = [
    "EXAMPLE_BYTES",
    "K",
    "STATS",
    "capture_text",
    "captures",
    "example_now",
    "examples_spec",
    "examples_table",
    "run_examples",
    "select",
    "shard_rows",
]
