"""A corpus run's per-text store: one Parquet row per (text, stack, layer, head, kind), written per shard.

Beside each shard record ``shards/NNNNN.json`` a run writes (before the record, which marks the
shard done, each file atomically: temp file, fsync, rename)

* ``shards/NNNNN.heads.parquet``: one row per captured text and head: ``text`` (its index in the
  run), ``stack``, ``layer``, ``head``, ``kind``, ``kv_head``, ``causal``, ``role`` and ``roles``
  (the role rules applied to this text's values) and every metric of
  :data:`~probe.analysis.focus.definitions.table.METRICS` (float32: the values the run's mean and
  spread were merged from, NaN where a metric is undefined for the text). One row group per
  (stack, layer, kind), rows ordered by head then text, so a query about one head reads one row
  group of each shard;
* ``shards/NNNNN.texts.parquet``: one row per text of the shard, failed ones too: ``text``,
  ``shard``, ``source`` (the text; a picture's name), ``n_tokens``, ``tokens``, ``ids``,
  ``error`` (null when captured) and, for a picture, ``picture`` (the picture as the model saw it,
  a base64 PNG at most :data:`PICTURE_SIDE` pixels on a side; for a sound, the spectrogram the
  model heard, at most :data:`SPECTROGRAM_SIDE` pixels wide).

They are plain Parquet files: DuckDB, pyarrow, Polars or Spark read them as they are
(:mod:`probe.corpus.queries` is the DuckDB side). pyarrow writes them (the ``explore`` extra).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from probe.analysis.focus.accumulator import FocusAccumulator
from probe.analysis.focus.definitions.table import METRICS, MIN_MATCHES, ROLE_RULES
from probe.errors import ProbeError
from probe.files import atomic_path

INSTALL = "pip install -c constraints.txt -e '.[explore]' (duckdb, pyarrow, starlette, uvicorn)"
PICTURE_SIDE = 96  # a picture's stored copy: at most this many pixels on its longer side
SPECTROGRAM_SIDE = 480  # a sound's stored spectrogram: at most this wide (time runs along it)
HEADS = "heads"  # shards/NNNNN.heads.parquet
TEXTS = "texts"  # shards/NNNNN.texts.parquet
KEYS = ["text", "stack", "layer", "head", "kind", "kv_head", "causal", "role", "roles"]


def pyarrow() -> Any:
    """The ``pyarrow`` module, or a one-line ProbeError naming the install command."""
    try:
        import pyarrow as pa
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ProbeError(f"the per-text store needs pyarrow; install it with `{INSTALL}`") from None
    return pa


def has_pyarrow() -> bool:
    """Whether pyarrow can be imported (a run stores per-text rows by default when it can)."""
    try:
        pyarrow()
        return True
    except ProbeError:
        return False


def shard_file(out: Path, shard: int, what: str) -> Path:
    """``out/shards/NNNNN.<what>.parquet``."""
    return out / "shards" / f"{shard:05d}.{what}.parquet"


class TextRowsAccumulator(FocusAccumulator):
    """A :class:`FocusAccumulator` that also keeps each fold's per-text values until
    :meth:`take` hands them over (every path that computes the statistics folds through it)."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[tuple[str, torch.Tensor, list[int], bool]] = []

    def fold(self, name, values, heads, causal, *, same_heads: bool = True) -> None:
        super().fold(name, values, heads, causal, same_heads=same_heads)
        self.pending.append((name, values.detach().to("cpu", torch.float32), list(heads), bool(causal)))

    def take(self) -> list[tuple[str, torch.Tensor, list[int], bool]]:
        """The folds since the last call: ``(name, values [B, H, M], heads, causal)``."""
        out, self.pending = self.pending, []
        return out


def text_roles(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(role, roles)`` of each row of metric values ``[N, M]`` (object arrays of strings): the
    role rules of :func:`~probe.analysis.focus.definitions.roles.roles_of`, on one text's values."""
    col = {m: i for i, m in enumerate(METRICS)}
    holds = np.zeros((values.shape[0], len(ROLE_RULES)), dtype=bool)
    with np.errstate(invalid="ignore"):
        for r, (role, metric, threshold) in enumerate(ROLE_RULES):
            v = values[:, col[metric]]
            ok = (v > threshold) if role == "sink" else (v >= threshold)
            if role in ("induction", "duplicate-token"):
                ok &= values[:, col[metric.replace("prefix", "matches")]] >= MIN_MATCHES
            holds[:, r] = ok & ~np.isnan(v)
    code = holds.astype(np.int64) @ (1 << np.arange(len(ROLE_RULES), dtype=np.int64))
    uniq, inv = np.unique(code, return_inverse=True)
    names = [[ROLE_RULES[r][0] for r in range(len(ROLE_RULES)) if c >> r & 1] for c in uniq]
    role = np.array([n[0] if n else "none" for n in names], dtype=object)[inv]
    roles = np.array([",".join(n) for n in names], dtype=object)[inv]
    return role, roles


class ShardRows:
    """The per-text rows of one shard while it runs; :meth:`write` stores them (see the module)."""

    def __init__(self, shard: int, start: int, sources: list[str]) -> None:
        self.shard, self.start, self.sources = shard, start, sources
        self.layers: dict[str, list[tuple[np.ndarray, np.ndarray, list[int], bool]]] = {}
        self.texts: dict[int, dict[str, Any]] = {}
        self.kv_group: int | None = None

    def add(self, folds: list, rows: list[int], meta: dict[str, Any], kv_group: int | None) -> None:
        """One batch: its ``folds`` (from :meth:`TextRowsAccumulator.take`), the shard's items
        ``rows`` in batch order, and the cache's metadata (tokens, ids, pictures)."""
        self.kv_group = kv_group or self.kv_group
        text = np.asarray([self.start + i for i in rows], dtype=np.int64)
        for name, values, heads, causal in folds:
            if values.shape[0] != len(rows):
                raise ProbeError(f"{name}: {values.shape[0]} rows of statistics for {len(rows)} texts")
            self.layers.setdefault(name, []).append((text, values.numpy(), heads, causal))
        for r, i in enumerate(rows):
            self.texts[i] = _text_row(meta, r, self.sources[i])

    def fail(self, i: int, error: str) -> None:
        """Item ``i`` of the shard failed: a texts row with its error, no head rows."""
        self.texts[i] = {"tokens": [], "ids": [], "n_tokens": 0, "error": error, "picture": None}

    def heads_table(self) -> list[Any]:
        """The heads rows as pyarrow tables, one per (stack, layer, kind) in fold order."""
        pa = pyarrow()
        out = []
        for name, parts in self.layers.items():
            stack, layer, kind = name.split("/")
            cols = _layer_columns(parts, self.kv_group)
            n = len(cols["text"])
            role, roles = text_roles(cols["values"])
            arrays = {
                "text": pa.array(cols["text"], pa.int64()),
                "stack": pa.array([stack] * n, pa.string()).dictionary_encode(),
                "layer": pa.array(np.full(n, int(layer), np.int16)),
                "head": pa.array(cols["head"], pa.int16()),
                "kind": pa.array([kind] * n, pa.string()).dictionary_encode(),
                "kv_head": pa.array(cols["kv_head"], pa.int16()),
                "causal": pa.array(cols["causal"], pa.bool_()),
                "role": pa.array(role, pa.string()).dictionary_encode(),
                "roles": pa.array(roles, pa.string()).dictionary_encode(),
            }
            for j, m in enumerate(METRICS):
                arrays[m] = pa.array(cols["values"][:, j], pa.float32())
            out.append(pa.table(arrays))
        return out

    def texts_table(self) -> Any:
        """The texts rows as one pyarrow table, in text order."""
        pa = pyarrow()
        order = sorted(self.texts)
        rows = [self.texts[i] for i in order]
        return pa.table(
            {
                "text": pa.array([self.start + i for i in order], pa.int64()),
                "shard": pa.array([self.shard] * len(rows), pa.int32()),
                "source": pa.array([self.sources[i] for i in order], pa.string()),
                "n_tokens": pa.array([r["n_tokens"] for r in rows], pa.int32()),
                "tokens": pa.array([r["tokens"] for r in rows], pa.list_(pa.string())),
                "ids": pa.array([r["ids"] for r in rows], pa.list_(pa.int32())),
                "error": pa.array([r["error"] for r in rows], pa.string()),
                "picture": pa.array([r["picture"] for r in rows], pa.string()),
            }
        )

    def write(self, out: Path) -> None:
        """Write the shard's two Parquet files atomically (heads, then texts)."""
        write_parquet(shard_file(out, self.shard, HEADS), self.heads_table(), empty=empty_heads())
        write_parquet(shard_file(out, self.shard, TEXTS), [self.texts_table()])


def _layer_columns(parts: list, kv_group: int | None) -> dict[str, np.ndarray]:
    """One layer's batches as columns ordered by head, then text."""
    text, head, values, causal = [], [], [], []
    for t, v, heads, c in parts:  # v: [B, H, M]
        B, H, _ = v.shape
        text.append(np.tile(t, H))
        head.append(np.repeat(np.asarray(heads, np.int64), B))
        values.append(v.transpose(1, 0, 2).reshape(B * H, -1))
        causal.append(np.full(B * H, c))
    cols = {
        "text": np.concatenate(text),
        "head": np.concatenate(head),
        "values": np.concatenate(values).astype(np.float32),
    }
    # a layer is causal as the statistics say: only while every batch was
    cols["causal"] = np.full(len(cols["text"]), bool(np.concatenate(causal).all()))
    order = np.lexsort((cols["text"], cols["head"]))
    cols = {k: v[order] for k, v in cols.items()}
    cols["kv_head"] = cols["head"] // kv_group if kv_group else np.full(len(order), -1)
    return cols


def _text_row(meta: dict[str, Any], r: int, source: str) -> dict[str, Any]:
    """A captured text's row: its real tokens and ids (padding left out), and its picture."""
    tokens = list((meta.get("tokens") or [[]])[r]) if meta.get("tokens") else []
    ids = list((meta.get("ids") or [[]])[r]) if meta.get("ids") else []
    mask = (meta.get("attention_mask") or [None] * (r + 1))[r]
    if mask is not None and len(mask) == len(tokens):
        keep = [i for i, m in enumerate(mask) if m]
        tokens = [tokens[i] for i in keep]
        ids = [ids[i] for i in keep] if len(ids) == len(mask) else ids
    pictures, side = meta.get("image_png") or [], PICTURE_SIDE
    if not pictures:  # a sound: the spectrogram the model heard, as the report draws it
        pictures, side = meta.get("spectrogram_png") or [], SPECTROGRAM_SIDE
    picture = _small_picture(pictures[r], side) if r < len(pictures) and pictures[r] else None
    return {
        "tokens": [str(t) for t in tokens],
        "ids": [int(i) for i in ids],
        "n_tokens": len(tokens),
        "error": None,
        "picture": picture,
    }


def _small_picture(b64: str, side: int = 96) -> str:
    """A base64 PNG scaled down to at most ``side`` pixels on its longer side."""
    import base64
    import io

    from PIL import Image

    img = Image.open(io.BytesIO(base64.b64decode(b64)))
    scale = side / max(img.size)
    if scale < 1:
        size = (max(1, math.floor(img.size[0] * scale)), max(1, math.floor(img.size[1] * scale)))
        img = img.resize(size, Image.Resampling.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=True)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def empty_heads() -> Any:
    """An empty heads table with the store's schema (a shard whose texts all failed)."""
    pa = pyarrow()
    fields = [
        ("text", pa.int64()),
        ("stack", pa.dictionary(pa.int32(), pa.string())),
        ("layer", pa.int16()),
        ("head", pa.int16()),
        ("kind", pa.dictionary(pa.int32(), pa.string())),
        ("kv_head", pa.int16()),
        ("causal", pa.bool_()),
        ("role", pa.dictionary(pa.int32(), pa.string())),
        ("roles", pa.dictionary(pa.int32(), pa.string())),
    ]
    fields += [(m, pa.float32()) for m in METRICS]
    return pa.schema(fields).empty_table()


def write_parquet(path: Path, tables: list[Any], *, empty: Any = None) -> Path:
    """Write ``tables`` (the same schema) as one Parquet file, a row group each, atomically;
    ``empty``: the table written when there is none."""
    pa = pyarrow()
    import pyarrow.parquet as pq

    tables = [t for t in tables if t.num_rows] or [empty if empty is not None else tables[0]]
    schema = tables[0].schema
    with atomic_path(path) as tmp:
        with pq.ParquetWriter(tmp, schema, compression="zstd") as w:
            for t in tables:
                w.write_table(t.cast(schema) if t.schema != schema else t, row_group_size=max(1, t.num_rows))
    del pa
    return path


__all__ = [
    "HEADS",
    "INSTALL",
    "KEYS",
    "PICTURE_SIDE",
    "TEXTS",
    "ShardRows",
    "TextRowsAccumulator",
    "empty_heads",
    "has_pyarrow",
    "pyarrow",
    "shard_file",
    "text_roles",
    "write_parquet",
]
