"""``probe.run_corpus``: capture many texts in bounded memory, shard by shard, resumably.

Layout of ``out_dir``::

    config.json              what was asked (model, texts digest, keep, batch and shard size)
    shards/00000.json        one per finished shard: every text's file and row (or its error),
                             and the shard's head statistics (FocusAccumulator.to_dict)
    shards/00000.heads.parquet, .texts.parquet   the shard's per-text store (probe.corpus.store),
                             written before its record
    shards/00000.examples.parquet   the shard's examples (probe.corpus.showcase), written after
                             every shard's record
    shards/00000/b000.safetensors   the shard's caches (one per batch; none with keep="stats")
    manifest.json            every text -> shard, file, row or error; written last
    head_stats.json / .csv   merged per-head mean +- std over all texts
    stats.json               the merged accumulator (exact: counts, means, M2)

Text ``i`` always lands in shard ``i // shard_size``, and a shard's batches depend only on its
texts, so results never depend on where a run was interrupted or how many ranks ran it. A shard is
done when its JSON exists (written atomically after its caches); a rerun skips done shards.

This module runs the whole: the configuration, resuming, ranks, and undoing a refused new run.
The parts: :mod:`.texts` (reading the texts), :mod:`.keep` (what is stored of each capture),
:mod:`.shards` (one shard's captures and records; merging them).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from probe.capture.engine.naming import model_info
from probe.capture.hooks.store import parse_dtype
from probe.corpus import shards
from probe.corpus.dist import Group
from probe.corpus.keep import KEEPS, keep_spec
from probe.corpus.pictures import (
    load_pictures,
    picture_inputs,
    picture_texts,
    pictures_digest,
    processor_name,
    run_picture_shard,
)
from probe.corpus.shards import finish
from probe.corpus.showcase import examples_spec, run_examples
from probe.corpus.sounds import load_sound_files, run_sound_shard, sound_inputs
from probe.corpus.store import has_pyarrow, pyarrow
from probe.corpus.texts import item_noun, load_texts
from probe.errors import ProbeError
from probe.files import check_writable_dir, write_text_atomic

__all__ = ["CorpusFailed", "KEEPS", "check_run_dir", "finish", "load_texts", "run_corpus"]


def _config(
    model,
    n: int,
    inputs: dict,
    keep,
    batch_size: int,
    shard_size: int,
    stats: bool,
    dtype,
    store: bool,
    examples: dict | None = None,
) -> dict:
    info = model_info(model)
    return {
        "model": {"name": info.get("name"), "class": info.get("class"), "parameters": info.get("parameters")},
        "n_texts": n,
        **inputs,  # texts: their digest; pictures: "inputs": "images", their digest, the processor
        "keep": keep,
        "stats": stats,
        "batch_size": batch_size,
        "shard_size": shard_size,
        "dtype": dtype,
        "store": store,
        "examples": examples,
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
    processor: Any = None,
    text: Any = None,
    dtype: Any = None,
    progress: bool = True,
    store: bool | None = None,
    examples: Any = None,
):
    """Capture every text of ``texts`` into ``out_dir`` in bounded memory; resumable; torchrun-aware.

    ``texts``: a list of strings, a text file (one text per line), a JSONL file (``field``, default
    ``"text"``) or a ``datasets.Dataset``. ``keep``: ``"stats"`` (no caches, statistics only),
    ``"all"`` (patterns and residuals), ``"residuals"`` or ``{"layers": [...], "heads": [...]}``
    (those patterns only; ``None`` for either means all of them).
    ``dtype`` (``"float16"``/``"bfloat16"``) casts what is stored (statistics read float32 either
    way). ``shard_size`` texts per shard, batches of ``batch_size`` texts of similar length. A
    text that fails (too long, out of vocabulary) is recorded (``Corpus.errors``) and skipped.

    Pictures for an image model: ``texts`` a folder (its image files, sorted by name), or a list of
    image paths, PIL images or numpy arrays, with ``processor`` the model's image processor
    (default: the model's own ``processor`` when it has no tokenizer). Each picture is one item
    (``"image"``), batched by processed size, statistics from whole patterns (the image metrics
    too): :mod:`probe.corpus.pictures`. For a
    vision-language model, ``text`` is what it reads beside each picture (``processor`` its
    processor, which places the image tokens): one text for every picture, or a list, one per
    picture (the manifest entry names it under ``"text"``).

    Sound for a speech model: a folder of sound files or their paths, ``processor`` its feature
    extractor (default: the model's own); each file an item (``"audio"``): :mod:`probe.corpus.sounds`.

    ``store`` (default: when pyarrow is installed and ``stats`` is on): also write each text's
    statistics per head as Parquet (:mod:`probe.corpus.store`; ``corpus.query``/``top``/``where``,
    ``probe serve``); ``examples`` (default ``True`` with the store; ``False``, or a dict of
    ``stats``, ``k``, ``positions``, ``keys``): each head's top and bottom texts, kept to be shown
    without their patterns (:mod:`probe.corpus.showcase`).

    Rerunning the same call resumes; another configuration in ``out_dir`` is refused. Under
    ``torchrun`` rank ``r`` takes shards ``i`` with ``i % world == r``; rank 0 merges.

    Returns a :class:`probe.corpus.read.Corpus` over ``out_dir`` (every rank gets it), or raises
    :class:`CorpusFailed` (a ProbeError: CLI exit 2) when every text failed, its manifest written.
    """
    from probe.corpus.read import Corpus

    keep, dtype = _check_args(batch_size, shard_size, keep, stats, dtype)
    out = Path(out_dir)
    settings = (keep, batch_size, shard_size, stats, dtype, _store(store, stats))
    cfg, n, run_shard, show = _inputs(model, texts, tokenizer, processor, field, settings, text, examples)
    resumed = _check_config(out, cfg)  # every rank checks: they all refuse alike, none waits forever
    existed = out.exists()
    group = Group()
    try:
        if group.rank == 0 and not resumed:
            write_text_atomic(out / "config.json", json.dumps(cfg, indent=1, ensure_ascii=False))
        group.barrier()
        _run_mine(run_shard, n, out, cfg, group, progress)
        group.barrier()
        if show is not None:  # every shard's statistics are in: each rank shows its shards' heads
            show(out, [i for i in range(-(-n // cfg["shard_size"])) if group.mine(i)], progress)
            group.barrier()
        if group.rank == 0:
            shards.finish(out)
        group.barrier()
    except ProbeError:
        if group.rank == 0 and not resumed:
            _undo_new_run(out, existed)
        raise
    finally:
        group.close()
    return _result(Corpus(out))


def _inputs(
    model,
    texts: Any,
    tokenizer: Any,
    processor: Any,
    field: Any,
    settings: tuple,
    text: Any = None,
    examples: Any = None,
) -> tuple:
    """``(config, n, run_shard, show)`` of the texts, pictures or sound files ``texts`` (``text``
    read beside the pictures): ``run_shard(a, b, folder, bar)`` captures items ``a:b`` into ``folder`` and
    returns the shard's record; ``show(out, shards)`` writes those shards' examples (None: no examples)."""
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if processor is None and tokenizer is None:  # an image model carrying its processor (vit_zoo)
        processor = getattr(model, "processor", None)
    if sound_inputs(texts):
        processor = processor if processor is not None else getattr(model, "processor", None)
        if processor is None:
            raise ProbeError(
                "sound files need processor= (the model's feature extractor) to become its features"
            )
        if field is not None or text is not None or examples:
            raise ProbeError(
                "field=, text= and examples= are for texts and pictures; drop them for sound files"
            )
        files, names = load_sound_files(texts)
        what = {
            "inputs": "audio",
            "audio_sha256": pictures_digest(files, names),
            "processor": processor_name(processor),
        }
        cfg = _config(model, len(files), what, *settings)

        def run_sounds(a: int, b: int, folder: Path, bar: Any) -> dict:
            mine = (files[a:b], names[a:b], a, folder, _shard_args(cfg, bar), bool(cfg.get("store")))
            return run_sound_shard(model, processor, *mine)

        return cfg, len(files), run_sounds, None
    if picture_inputs(texts, processor):
        items, names = _pictures(texts, processor, field, model)
        prompts = picture_texts(text, len(items))
        what = {
            "inputs": "images",
            "images_sha256": pictures_digest(items, names),
            "processor": processor_name(processor),
        }
        if prompts is not None:
            what["texts_sha256"] = hashlib.sha256("\x00".join(prompts).encode("utf-8")).hexdigest()
        if examples:
            raise ProbeError("examples= are kept for text runs; drop it for pictures")
        cfg = _config(model, len(items), what, *settings)

        def run_pictures(a: int, b: int, folder: Path, bar: Any) -> dict:
            mine = prompts[a:b] if prompts is not None else None
            settings = _shard_args(cfg, bar)
            return run_picture_shard(
                model, processor, items[a:b], names[a:b], a, folder, settings, mine, bool(cfg.get("store"))
            )

        return cfg, len(items), run_pictures, None
    if text is not None:
        raise ProbeError("text= is read beside pictures: give pictures and processor=, or drop text=")
    texts = load_texts(texts, field=field)
    digest = hashlib.sha256("\x00".join(texts).encode("utf-8")).hexdigest()
    store = settings[-1]
    if examples and not store:
        raise ProbeError("examples= are chosen from the per-text store; it needs store=True (and pyarrow)")
    spec = examples_spec(store if examples is None else examples)
    cfg = _config(model, len(texts), {"texts_sha256": digest}, *settings, spec)

    def run_texts(a: int, b: int, folder: Path, bar: Any) -> dict:
        return shards.run_shard(
            model, tokenizer, texts[a:b], a, folder, *_shard_args(cfg, bar), store=bool(cfg.get("store"))
        )

    def show(out: Path, mine: list[int], progress: bool = False) -> None:
        run_examples(model, tokenizer, texts, out, cfg, mine, progress)

    return cfg, len(texts), run_texts, (show if spec else None)


def _check_args(
    batch_size: Any, shard_size: Any, keep: Any, stats: bool, dtype: Any
) -> tuple[Any, str | None]:
    """``(keep, dtype)`` checked and spelled as config.json records them; ProbeError otherwise."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ProbeError(f"batch_size={batch_size!r}: give a positive integer")
    if not isinstance(shard_size, int) or shard_size < 1:
        raise ProbeError(f"shard_size={shard_size!r}: give a positive integer")
    keep = keep_spec(keep)
    if dtype is not None:
        dtype = str(parse_dtype(dtype)).replace("torch.", "")  # one spelling in config.json: "float16"
    if keep == "stats" and not stats:
        raise ProbeError("keep='stats' with stats=False would store nothing; keep patterns or compute stats")
    return keep, dtype


def _store(store: bool | None, stats: bool) -> bool:
    """Whether the run writes per-text rows: ``store`` checked (they need ``stats`` and pyarrow)."""
    if store is None:
        return stats and has_pyarrow()
    if store and not stats:
        raise ProbeError("store=True keeps each text's statistics; it needs stats=True")
    if store:
        pyarrow()  # a one-line error naming the install when it is missing
    return bool(store)


def _pictures(inputs: Any, processor: Any, field: Any, model: Any) -> tuple[list, list]:
    """The pictures of a picture run, checked: a processor to read them, no ``field``."""
    if processor is None:
        raise ProbeError(
            f"pictures need processor= (the image processor of {model_info(model).get('name')}) "
            "to become pixel_values"
        )
    if field is not None:
        raise ProbeError("field= names a JSONL field of texts; drop it for pictures")
    return load_pictures(inputs)


def _shard_args(cfg: dict, bar: Any) -> tuple:
    """The settings every shard runner takes after its items and folder."""
    return cfg["keep"], cfg["batch_size"], cfg["stats"], bar, cfg["dtype"]


def _run_mine(run_shard: Any, n: int, out: Path, cfg: dict, group: Group, progress: bool) -> None:
    """Capture this rank's unfinished shards, each record written atomically after its caches;
    ``run_shard(a, b, folder, bar)`` captures items ``a:b`` and returns the shard's record."""
    shard_size = cfg["shard_size"]
    n_shards = -(-n // shard_size)
    todo = [
        i
        for i in range(n_shards)
        if group.mine(i) and not shards.shard_done(out / "shards" / f"{i:05d}.json")
    ]
    total = sum(min(n, (i + 1) * shard_size) - i * shard_size for i in todo)
    desc = "corpus" if group.world == 1 else f"corpus rank {group.rank}"
    unit = item_noun(cfg)
    with tqdm(total=total, desc=desc, unit=unit, disable=not progress, smoothing=0.1) as bar:
        for i in todo:
            folder = out / "shards" / f"{i:05d}"
            # this shard's record may have been half-written by a killed run: drop its temp files
            shards.remove_stale(out / "shards", f".{i:05d}.json.*.tmp", f".{i:05d}.*.parquet.*.tmp")
            rec = run_shard(i * shard_size, min(n, (i + 1) * shard_size), folder, bar)
            write_text_atomic(out / "shards" / f"{i:05d}.json", json.dumps(rec, ensure_ascii=False))


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
        what = item_noun(corpus.config)
        which = first if what != "text" else f"text {i}: {first}"  # a picture's or sound's error names it
        super().__init__(
            f"no {what} captured: all {m['n_texts']:,} {what}s failed ({which}); "
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
