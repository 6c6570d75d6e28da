"""``probe.run_corpus``: capture many texts in bounded memory, shard by shard, resumably.

Layout of ``out_dir``::

    config.json              what was asked (model, texts digest, keep, batch and shard size)
    shards/00000.json        one per finished shard: every text's file and row (or its error),
                             and the shard's head statistics (FocusAccumulator.to_dict)
    shards/00000/b000.safetensors   the shard's caches (one per batch; none with keep="stats")
    manifest.json            every text -> shard, file, row or error; written last
    head_stats.json / .csv   merged per-head mean +- std over all texts
    stats.json               the merged accumulator (exact: counts, means, M2)

Text ``i`` always lands in shard ``i // shard_size``, and a shard's batches depend only on its
texts, so results never depend on where a run was interrupted or how many ranks ran it. A shard is
done when its JSON exists (written atomically after its caches); a rerun skips done shards.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from probe.analysis.focus.stats import FocusAccumulator
from probe.cache import Cache
from probe.cache.selection import Selection
from probe.capture import capture
from probe.capture.engine import parse_dtype
from probe.capture.naming import model_info
from probe.corpus.dist import Group
from probe.errors import ProbeError
from probe.files import check_writable_dir, input_file, write_text_atomic

KEEPS = ("stats", "all", "residuals")


def load_texts(texts: Any, *, field: str | None = None) -> list[str]:
    """The texts of a list, a text file (one per non-empty line), JSONL (``field``) or a Dataset."""
    if isinstance(texts, (str, os.PathLike)):
        p = input_file(texts, "texts file", "give a .txt (one text per line) or .jsonl file")
        lines = [ln for ln in p.read_text(encoding="utf-8").splitlines() if ln.strip()]
        if p.suffix == ".jsonl" or field is not None:
            key = field or "text"
            out = []
            for n, ln in enumerate(lines, 1):
                try:
                    rec = json.loads(ln)
                    out.append(rec[key])
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ProbeError(
                        f"{p}: record {n} is not a JSON object with a {key!r} field; pass --field NAME"
                    ) from None
            lines = out
        texts = lines
    elif hasattr(texts, "column_names"):  # a datasets.Dataset (optional package)
        key = field or "text"
        if key not in texts.column_names:
            raise ProbeError(
                f"the dataset has no column {key!r} (columns: {texts.column_names}); pass field="
            )
        texts = texts[key]
    texts = list(texts)
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
    if bad:
        raise ProbeError(f"text {bad[0]} is a {type(texts[bad[0]]).__name__}, not a string")
    if not texts:
        raise ProbeError("no texts given; pass a list of strings or a file with one text per line")
    return texts


def _keep_spec(keep: Any) -> Any:
    if isinstance(keep, str):
        if keep not in KEEPS:
            raise ProbeError(f"keep={keep!r}: use one of {KEEPS} or {{'layers': [...], 'heads': [...]}}")
        return keep
    if isinstance(keep, dict) and set(keep) <= {"layers", "heads"} and keep:
        sel = Selection.from_keep(keep)
        return {"layers": sel.layers, "heads": sel.heads}
    raise ProbeError(f"keep={keep!r}: use one of {KEEPS} or {{'layers': [...], 'heads': [...]}}")


def _kept(cache: Cache, keep: Any, dtype: Any = None) -> Cache | None:
    """The part of ``cache`` that ``keep`` stores (None: nothing), its floats cast to ``dtype``."""
    part = _select(cache, keep)
    if part is None or dtype is None:
        return part
    dt = parse_dtype(dtype)
    tensors = {k: part[k].to(dt) if part[k].is_floating_point() else part[k] for k in part.keys()}
    meta = dict(part.metadata)
    meta["dtype"] = ", ".join(sorted({str(t.dtype).replace("torch.", "") for t in tensors.values()}))
    return Cache(tensors, meta)


def _select(cache: Cache, keep: Any) -> Cache | None:
    if keep == "stats":
        return None
    if keep == "all":
        return cache
    if keep == "residuals":
        kept = {k: cache[k] for k in cache.keys() if not k.endswith("_attn.pattern")}
        return Cache(kept, dict(cache.metadata))
    return Selection.from_keep(keep).patterns(cache)


def _config(model, texts: list[str], keep, batch_size: int, shard_size: int, stats: bool, dtype) -> dict:
    info = model_info(model)
    digest = hashlib.sha256("\x00".join(texts).encode("utf-8")).hexdigest()
    return {
        "model": {"name": info.get("name"), "class": info.get("class"), "parameters": info.get("parameters")},
        "n_texts": len(texts),
        "texts_sha256": digest,
        "keep": keep,
        "stats": stats,
        "batch_size": batch_size,
        "shard_size": shard_size,
        "dtype": dtype,
    }


def check_run_dir(out_dir: str | os.PathLike) -> Path:
    """``out_dir`` as a Path when a corpus run can be written there; else a one-line
    :class:`ProbeError` (a file, a file on the way, no permission), raised before any work."""
    return check_writable_dir(out_dir, "config.json", "the corpus run")


def _check_config(out: Path, cfg: dict) -> bool:
    """True when ``out`` already holds this run; ProbeError when it holds another one."""
    p = check_run_dir(out) / "config.json"
    if not p.exists():
        if out.exists() and any(not f.name.startswith(".") for f in out.iterdir()):
            raise ProbeError(f"{out} is not empty and holds no corpus run; give a new or empty directory")
        return False
    try:
        old = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        raise ProbeError(f"{p} is unreadable; remove {out} to start over") from None
    diff = [k for k in cfg if old.get(k) != cfg[k]]
    if diff:
        what = ", ".join(f"{k}: {old.get(k)!r} -> {cfg[k]!r}" for k in diff)
        raise ProbeError(
            f"{out} holds a different corpus run ({what}); use the same settings to resume, or another -o"
        )
    return True


def _shard_done(path: Path) -> bool:
    try:
        json.loads(path.read_text(encoding="utf-8"))
        return True
    except (OSError, json.JSONDecodeError):
        return False


def _remove_stale(folder: Path, *patterns: str) -> None:
    """Delete the files of ``folder`` matching ``patterns``: temp files a killed write left."""
    for pattern in patterns:
        for stale in folder.glob(pattern) if folder.exists() else ():
            stale.unlink(missing_ok=True)


def _run_shard(model, tokenizer, texts, start, folder: Path, keep, batch_size, stats, bar, dtype) -> dict:
    """Capture one shard's texts (bucketed by length) and return its JSON record."""
    # left by a killed writer: our temp files (.NAME.XXXX.tmp) and safetensors' own (.tmpXXXXXX,
    # which its save_file writes before renaming onto ours)
    _remove_stale(folder, ".*.tmp", ".tmp*")
    order = sorted(range(len(texts)), key=lambda i: (len(texts[i]), i))
    batches = [order[j : j + batch_size] for j in range(0, len(order), batch_size)]
    acc = FocusAccumulator()
    entries: list[dict | None] = [None] * len(texts)
    n_files = 0

    def store(cache: Cache, rows: list[int]) -> None:
        nonlocal n_files
        if stats:
            acc.add(cache)
        part = _kept(cache, keep, dtype)  # statistics above read the float32 patterns
        rel = None
        if part is not None:
            rel = f"shards/{folder.name}/b{n_files:03d}.safetensors"
            part.save(folder.parent.parent / rel)
            n_files += 1
        for r, i in enumerate(rows):
            entries[i] = {"shard": int(folder.name), "file": rel, "row": r}

    for rows in batches:
        try:
            caches = [(capture(model, [texts[i] for i in rows], tokenizer=tokenizer), rows)]
        except ProbeError:
            # one bad text fails the batch: isolate it (each text alone), record it, go on
            caches = []
            for i in rows:
                try:
                    caches.append((capture(model, [texts[i]], tokenizer=tokenizer), [i]))
                except ProbeError as e:
                    entries[i] = {"shard": int(folder.name), "error": str(e)}
        for cache, got in caches:  # errors past capture are probe's or the disk's: they stop the run
            store(cache, got)
        del caches
        bar.update(len(rows))
    return {
        "shard": int(folder.name),
        "start": start,
        "texts": entries,
        "files": n_files,
        "stats": acc.to_dict() if stats and acc.n_texts else None,
    }


def run_corpus(
    model,
    texts: Any,
    out_dir: str | os.PathLike,
    *,
    tokenizer: Any = None,
    batch_size: int = 8,
    keep: Any = "stats",
    stats: bool = True,
    shard_size: int = 256,
    field: str | None = None,
    dtype: Any = None,
    progress: bool = True,
):
    """Capture every text of ``texts`` into ``out_dir`` in bounded memory; resumable; torchrun-aware.

    ``texts``: a list of strings, a text file (one text per line), a JSONL file (``field``, default
    ``"text"``) or a ``datasets.Dataset``. ``keep``: ``"stats"`` (no caches, statistics only),
    ``"all"`` (patterns and residuals), ``"residuals"`` or ``{"layers": [...], "heads": [...]}``
    (those patterns only; ``None`` for either means all of them).
    ``dtype`` (``"float16"``/``"bfloat16"``) casts what is stored, halving the disk; statistics are
    computed from the float32 patterns either way (default: stored as captured, patterns float32).
    ``shard_size`` texts per shard, batches of ``batch_size`` texts of similar length. A text that
    fails (ProbeError: too long, out of vocabulary) is recorded in the manifest (``Corpus.errors``)
    and skipped.
    Rerunning the same call resumes; another configuration in ``out_dir`` is refused. Under
    ``torchrun`` rank ``r`` takes shards ``i`` with ``i % world == r``; rank 0 merges.

    Returns a :class:`probe.corpus.read.Corpus` over ``out_dir`` (every rank gets it), or raises
    :class:`CorpusFailed` (a ProbeError: CLI exit 2) when every text failed, its manifest written.
    """
    from probe.corpus.read import Corpus

    if not isinstance(batch_size, int) or batch_size < 1:
        raise ProbeError(f"batch_size={batch_size!r}: give a positive integer")
    if not isinstance(shard_size, int) or shard_size < 1:
        raise ProbeError(f"shard_size={shard_size!r}: give a positive integer")
    keep = _keep_spec(keep)
    if dtype is not None:
        dtype = str(parse_dtype(dtype)).replace("torch.", "")  # one spelling in config.json: "float16"
    if keep == "stats" and not stats:
        raise ProbeError("keep='stats' with stats=False would store nothing; keep patterns or compute stats")
    texts = load_texts(texts, field=field)
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    out = Path(out_dir)
    cfg = _config(model, texts, keep, batch_size, shard_size, stats, dtype)
    resumed = _check_config(out, cfg)  # every rank checks: they all refuse alike, none waits forever
    existed = out.exists()
    group = Group()
    try:
        if group.rank == 0 and not resumed:
            write_text_atomic(out / "config.json", json.dumps(cfg, indent=1, ensure_ascii=False))
        group.barrier()
        n_shards = -(-len(texts) // shard_size)
        todo = [
            i for i in range(n_shards) if group.mine(i) and not _shard_done(out / "shards" / f"{i:05d}.json")
        ]
        total = sum(len(texts[i * shard_size : (i + 1) * shard_size]) for i in todo)
        desc = "corpus" if group.world == 1 else f"corpus rank {group.rank}"
        with tqdm(total=total, desc=desc, unit="text", disable=not progress, smoothing=0.1) as bar:
            for i in todo:
                part = texts[i * shard_size : (i + 1) * shard_size]
                folder = out / "shards" / f"{i:05d}"
                # this shard's record may have been half-written by a killed run: drop its temp files
                _remove_stale(out / "shards", f".{i:05d}.json.*.tmp")
                rec = _run_shard(
                    model, tokenizer, part, i * shard_size, folder, keep, batch_size, stats, bar, dtype
                )
                write_text_atomic(out / "shards" / f"{i:05d}.json", json.dumps(rec, ensure_ascii=False))
        group.barrier()
        if group.rank == 0:
            finish(out)
        group.barrier()
    except ProbeError:
        if group.rank == 0 and not resumed:
            _undo_new_run(out, existed)
        raise
    finally:
        group.close()
    return _result(Corpus(out))


class CorpusFailed(ProbeError):
    """A corpus run in which every text failed: nothing was captured.

    The run itself is complete on disk (its manifest records each text's error), so the failure
    is raised instead of returning an empty corpus that would only fail later; ``.corpus`` is the
    :class:`~probe.corpus.read.Corpus` for inspecting the errors (``.corpus.errors``)."""

    def __init__(self, corpus: Any) -> None:
        m = corpus.manifest
        i, err = next(iter(corpus.errors.items()))
        first = (str(err).splitlines() or [""])[0]
        first = first if len(first) <= 160 else first[:157] + "..."
        super().__init__(
            f"no text captured: all {m['n_texts']:,} texts failed (text {i}: {first}); "
            f"each error is in {corpus.path / 'manifest.json'}"
        )
        self.corpus = corpus


def _result(corpus: Any) -> Any:
    """``corpus``, or :class:`CorpusFailed` raised when it holds texts and captured none."""
    if corpus.manifest["n_texts"] and not corpus.manifest["n_ok"]:
        raise CorpusFailed(corpus)
    return corpus


def _undo_new_run(out: Path, existed: bool) -> None:
    """Remove a new run refused before any shard finished (e.g. ``keep`` names a layer the model lacks),
    so the corrected command starts afresh instead of meeting "holds a different corpus run"."""
    shards = out / "shards"
    if any(p.is_file() for p in shards.rglob("*")):
        return  # something was written (a full disk mid-shard): keep the run, rerunning resumes it
    (out / "config.json").unlink(missing_ok=True)
    for folder in [*sorted(shards.glob("*"), reverse=True), shards] + ([] if existed else [out]):
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty: nothing but what this call created is removed


def finish(out: Path) -> dict:
    """Merge the shard records of ``out`` (in shard order) into manifest.json and head_stats.*."""
    cfg = json.loads((out / "config.json").read_text(encoding="utf-8"))
    # a killed run's half-written config, manifest or statistics; no other rank writes here now
    _remove_stale(out, ".*.tmp")
    n_shards = -(-cfg["n_texts"] // cfg["shard_size"])
    entries: list[dict] = []
    acc = FocusAccumulator()
    files: list[str] = []
    for i in range(n_shards):
        p = out / "shards" / f"{i:05d}.json"
        if not _shard_done(p):
            raise ProbeError(f"shard {i} of {out} is not finished; rerun the same command to complete it")
        rec = json.loads(p.read_text(encoding="utf-8"))
        entries += rec["texts"]
        files += [f"shards/{i:05d}/b{j:03d}.safetensors" for j in range(rec["files"])]
        if rec["stats"]:
            acc.merge(FocusAccumulator.from_dict(rec["stats"]))
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
        write_text_atomic(out / "stats.json", json.dumps(acc.to_dict()))
        hs = acc.result()
        hs.to_json(out / "head_stats.json")
        hs.to_csv(out / "head_stats.csv")
    write_text_atomic(out / "manifest.json", json.dumps(manifest, indent=1, ensure_ascii=False))
    return manifest


def shard_files(out: Path) -> Iterable[str]:
    """Relative cache paths of a finished run, in order."""
    return json.loads((out / "manifest.json").read_text(encoding="utf-8"))["files"]
