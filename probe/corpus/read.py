"""``probe.open_corpus``: read a corpus run back, one cache file open at a time."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from probe.analysis.focus.accumulator import FocusAccumulator
from probe.analysis.focus.result import HeadStats
from probe.cache import Cache, load
from probe.corpus.texts import item_noun
from probe.errors import ProbeError
from probe.files import human_size


class Corpus:
    """A finished corpus run: iterate it for its caches (lazily), or read its merged statistics.

    ``for cache in corpus`` yields one :class:`probe.Cache` per stored batch file (memory-mapped,
    opened only when reached), so ``probe.head_stats(corpus)`` and per-cache analyses
    (``check_causal``, ``align``) read any corpus the way they read one cache.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        m = self.path / "manifest.json"
        if not m.is_file():
            if (self.path / "config.json").is_file():
                raise ProbeError(
                    f"{self.path}: the corpus run is unfinished; rerun the same command to resume"
                )
            raise ProbeError(
                f"{self.path} is not a corpus run (no manifest.json); make one with probe corpus"
            )
        try:
            self.manifest: dict[str, Any] = json.loads(m.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            raise ProbeError(f"{m} is not valid JSON; rerun the corpus command to rewrite it") from None

    @property
    def config(self) -> dict[str, Any]:
        """The settings of the run (model, keep, batch and shard size, texts digest)."""
        return self.manifest["config"]

    @property
    def files(self) -> list[Path]:
        """The stored cache files, in shard order (empty when only statistics were kept)."""
        return [self.path / f for f in self.manifest["files"]]

    @property
    def texts(self) -> list[dict[str, Any]]:
        """Per text (in input order): ``{"shard", "file", "row"}`` or ``{"shard", "error"}``; a
        picture's entry also names it: ``"image"``, its file's path (a folder's: its name) or, for a
        picture given in memory, its index."""
        return self.manifest["texts"]

    @property
    def errors(self) -> dict[int, str]:
        """Text index -> error message of every text that could not be captured."""
        return {i: e["error"] for i, e in enumerate(self.texts) if "error" in e}

    def __len__(self) -> int:
        return len(self.manifest["files"])

    def __iter__(self) -> Iterator[Cache]:
        for f in self.files:
            yield load(f)

    def cache_of(self, index: int) -> tuple[Cache, int]:
        """``(cache, row)`` holding text ``index`` (ProbeError if it failed or was not stored)."""
        e = self.texts[index]
        if "error" in e:
            raise ProbeError(f"text {index} failed: {e['error']}")
        if e.get("file") is None:
            raise ProbeError(f"text {index} was not stored (keep='stats'); rerun with keep='all'")
        return load(self.path / e["file"]), e["row"]

    def head_stats(self) -> HeadStats:
        """The merged per-head statistics of the run (mean +- std over all captured texts)."""
        p = self.path / "stats.json"
        if not p.is_file():
            raise ProbeError(f"{self.path}: the run computed no statistics (stats=False)")
        d = json.loads(p.read_text(encoding="utf-8"))
        acc = FocusAccumulator.from_dict(d)
        acc.leave_out(d.get("not_computed") or {})  # left out while the model ran, and why
        return acc.result()

    # -- the per-text store (probe.corpus.queries) ----------------------------------------------
    @property
    def store(self) -> Any:
        """The run's per-text store, :class:`~probe.corpus.queries.Store` (DuckDB over its Parquet)."""
        if getattr(self, "_store", None) is None:
            from probe.corpus.queries import Store

            self._store = Store(self.path)
        return self._store

    def query(self, sql: str, params: list | None = None) -> Any:
        """Any SQL over the views ``heads`` (a row per text and head), ``texts`` and ``examples``:
        a :class:`~probe.analysis.table.Table` (:meth:`Store.query <probe.corpus.queries.Store.query>`)."""
        return self.store.query(sql, params)

    def top(self, layer: int, head: int, stat: str, k: int = 20, **kw: Any) -> Any:
        """The ``k`` texts with the largest ``stat`` for one head (:meth:`Store.top
        <probe.corpus.queries.Store.top>`)."""
        return self.store.top(layer, head, stat, k, **kw)

    def bottom(self, layer: int, head: int, stat: str, k: int = 20, **kw: Any) -> Any:
        """The ``k`` texts with the smallest ``stat`` for one head."""
        return self.store.bottom(layer, head, stat, k, **kw)

    def where(self, condition: str, **kw: Any) -> Any:
        """Every (text, head) row where the SQL ``condition`` holds (``"first > 0.9 and layer = 3"``)."""
        return self.store.where(condition, **kw)

    def summary(self) -> str:
        """A few readable lines: model, texts, failures, shards, files and disk use."""
        m, c = self.manifest, self.config
        size = sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())
        has_stats = (self.path / "stats.json").is_file()
        keep = c["keep"] if isinstance(c["keep"], str) else json.dumps(c["keep"])
        what = item_noun(c)
        lines = [
            f"{self.path}  (corpus run, {human_size(size)})",
            f"model:     {c['model'].get('name')}  ({c['model'].get('class')}, "
            f"{c['model'].get('parameters') or 0:,} parameters)",
            f"{what + 's:':<10} {m['n_texts']:,} ({m['n_ok']:,} captured, {m['n_failed']:,} failed)",
            f"shards:    {m['n_shards']} of {c['shard_size']} {what}s, batches of {c['batch_size']}",
            f"kept:      {keep}; {len(m['files'])} cache files"
            + (f", stored as {c['dtype']}" if c.get("dtype") and m["files"] else ""),
            f"stats:     {'head_stats.json / head_stats.csv' if has_stats else 'none'}",
        ]
        for i, err in list(self.errors.items())[:5]:
            # a picture's error already names it ("image 3: cannot read 'x.png' ...")
            lines.append(f"failed:    {err}" if what != "text" else f"failed:    text {i}: {err}")
        if m["n_failed"] > 5:
            lines.append(f"           ... and {m['n_failed'] - 5} more (see manifest.json)")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        import html

        return f"<pre>{html.escape(self.summary())}</pre>"

    def __repr__(self) -> str:
        return f"<probe.Corpus {self.path}: {self.manifest['n_texts']} texts, {len(self)} files>"


def open_corpus(path: str | os.PathLike) -> Corpus:
    """The corpus run at ``path`` (a directory written by :func:`probe.run_corpus`)."""
    return Corpus(path)
