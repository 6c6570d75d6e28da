"""A corpus run's shards: capture one shard's texts into its folder and record it; merge the records.

Text ``i`` lands in shard ``i // shard_size``; a shard's batches depend only on its texts. A shard is
done when its JSON record exists (:func:`shard_done`); :func:`finish` merges the records into
``manifest.json`` and the head statistics. The layout is described in :mod:`probe.corpus.run`.
"""

from __future__ import annotations

import json
from pathlib import Path

from probe import interrupt
from probe.analysis.focus.accumulator import FocusAccumulator
from probe.cache import Cache
from probe.capture import capture
from probe.corpus.keep import kept
from probe.corpus.store import ShardRows, TextRowsAccumulator
from probe.entry import capture as capture_stats
from probe.errors import ProbeError
from probe.files import write_text_atomic


def shard_done(path: Path) -> bool:
    """Whether the shard record at ``path`` exists and is complete JSON."""
    try:
        json.loads(path.read_text(encoding="utf-8"))
        return True
    except (OSError, json.JSONDecodeError):
        return False


def remove_stale(folder: Path, *patterns: str) -> None:
    """Delete the files of ``folder`` matching ``patterns``: temp files a killed write left."""
    for pattern in patterns:
        for stale in folder.glob(pattern) if folder.exists() else ():
            stale.unlink(missing_ok=True)


class ShardRecord:
    """One shard's record while it runs: stores each capture (statistics folded in, the kept part
    saved as the shard's next batch file), notes each failure, and gives the JSON record.
    ``sources`` (each item's text, or a picture's name): also keep each item's per-text rows
    (:class:`~probe.corpus.store.ShardRows`), written beside the record."""

    def __init__(
        self, folder: Path, n: int, keep, stats: bool, dtype, start: int, sources: list[str] | None = None
    ) -> None:
        # left by a killed writer: our temp files (.NAME.XXXX.tmp) and safetensors' own (.tmpXXXXXX,
        # which its save_file writes before renaming onto ours)
        remove_stale(folder, ".*.tmp", ".tmp*")
        self.folder, self.keep, self.stats, self.dtype, self.start = folder, keep, stats, dtype, start
        self.shard = int(folder.name)
        self.rows = ShardRows(self.shard, start, sources) if sources is not None and stats else None
        self.acc = TextRowsAccumulator() if self.rows is not None else FocusAccumulator()
        self.entries: list[dict | None] = [None] * n
        self.n_files = 0

    def store(self, cache: Cache, rows: list[int], extra: list[dict] | None = None) -> None:
        """Fold ``cache`` (its batch rows are the shard's items ``rows``) into the statistics and
        save what ``keep`` stores; ``extra`` adds fields to each row's manifest entry."""
        if self.stats:
            self.acc.add(cache)
        if self.rows is not None:
            self.rows.add(self.acc.take(), rows, cache.metadata, self.acc.kv_group)
        part = kept(cache, self.keep, self.dtype)  # statistics above read the float32 patterns
        rel = None
        if part is not None:
            rel = f"shards/{self.folder.name}/b{self.n_files:03d}.safetensors"
            part.save(self.folder.parent.parent / rel)
            self.n_files += 1
        for r, i in enumerate(rows):
            self.entries[i] = {"shard": self.shard, **(extra[r] if extra else {}), "file": rel, "row": r}

    def fail(self, i: int, error: str, extra: dict | None = None) -> None:
        """Item ``i`` of the shard could not be captured: its manifest entry is the error."""
        self.entries[i] = {"shard": self.shard, **(extra or {}), "error": error}
        if self.rows is not None:
            self.rows.fail(i, error)

    def record(self) -> dict:
        """The shard's JSON record (see :mod:`probe.corpus.run`); the per-text rows, when kept, are
        written first (``shards/NNNNN.heads.parquet`` and ``.texts.parquet``): the record, written
        after them, marks the shard done."""
        if self.rows is not None:
            self.rows.write(self.folder.parent.parent)
        stats = None
        if self.stats and self.acc.n_texts:
            stats = self.acc.to_dict()
            if self.acc.not_computed:  # what statistics computed while the model ran leave out
                stats["not_computed"] = dict(self.acc.not_computed)
        return {
            "shard": self.shard,
            "start": self.start,
            "texts": self.entries,
            "files": self.n_files,
            "stats": stats,
        }


def run_shard(
    model, tokenizer, texts, start, folder: Path, keep, batch_size, stats, bar, dtype, store: bool = False
) -> dict:
    """Capture one shard's texts (bucketed by length) and return its JSON record. With
    ``keep="stats"`` each batch's statistics are computed block by block while the model runs
    (``probe.capture(..., keep="stats")``): a batch holds one row block of patterns, never a layer's.
    ``store``: also write the shard's per-text rows (:mod:`probe.corpus.store`)."""
    rec = ShardRecord(folder, len(texts), keep, stats, dtype, start, list(texts) if store else None)
    order = sorted(range(len(texts)), key=lambda i: (len(texts[i]), i))
    batches = [order[j : j + batch_size] for j in range(0, len(order), batch_size)]

    def run(batch: list[str]) -> Cache:
        if keep == "stats":
            return capture_stats(model, batch, tokenizer=tokenizer, keep="stats")
        return capture(model, batch, tokenizer=tokenizer)

    for rows in batches:
        try:
            caches = [(run([texts[i] for i in rows]), rows)]
        except ProbeError:
            # one bad text fails the batch: isolate it (each text alone), record it, go on
            caches = []
            for i in rows:
                try:
                    caches.append((run([texts[i]]), [i]))
                except ProbeError as e:
                    rec.fail(i, str(e))
        for cache, got in caches:  # errors past capture are probe's or the disk's: they stop the run
            rec.store(cache, got)
        del caches
        bar.update(len(rows))
        interrupt.check()  # a Ctrl-C swallowed inside a __del__ stops the run here (command line)
    return rec.record()


def finish(out: Path) -> dict:
    """Merge the shard records of ``out`` (in shard order) into manifest.json and head_stats.*."""
    cfg = json.loads((out / "config.json").read_text(encoding="utf-8"))
    # a killed run's half-written config, manifest or statistics; no other rank writes here now
    remove_stale(out, ".*.tmp")
    n_shards = -(-cfg["n_texts"] // cfg["shard_size"])
    entries: list[dict] = []
    acc = FocusAccumulator()
    files: list[str] = []
    not_computed: dict[str, str] = {}
    for i in range(n_shards):
        p = out / "shards" / f"{i:05d}.json"
        if not shard_done(p):
            raise ProbeError(f"shard {i} of {out} is not finished; rerun the same command to complete it")
        rec = json.loads(p.read_text(encoding="utf-8"))
        entries += rec["texts"]
        files += [f"shards/{i:05d}/b{j:03d}.safetensors" for j in range(rec["files"])]
        if rec["stats"]:
            acc.merge(FocusAccumulator.from_dict(rec["stats"]))
            not_computed.update(rec["stats"].get("not_computed") or {})
    failed = sum("error" in e for e in entries)
    manifest = {
        "format": "probe-corpus/1",
        "config": cfg,
        "n_texts": len(entries),
        "n_ok": len(entries) - failed,
        "n_failed": failed,
        "n_shards": n_shards,
        "files": files,
        "texts": entries,
    }
    if cfg["stats"] and acc.n_texts:
        merged = acc.to_dict()
        if not_computed:  # kept beside the accumulator: Corpus.head_stats says what is missing
            merged["not_computed"] = not_computed
        write_text_atomic(out / "stats.json", json.dumps(merged))
        acc.leave_out(not_computed)
        hs = acc.result()
        hs.to_json(out / "head_stats.json")
        hs.to_csv(out / "head_stats.csv")
    write_text_atomic(out / "manifest.json", json.dumps(manifest, indent=1, ensure_ascii=False))
    return manifest


__all__ = ["ShardRecord", "finish", "remove_stale", "run_shard", "shard_done"]
