"""What the transcript heard: for a cache of an audio encoder-decoder (encoder positions that carry
their time, a decoder holding the transcript), the cross-attention of the heads
:func:`probe.word_timestamps` chooses laid out over time, one row per word, with each word placed
at its timestamps (refined on the sound; Whisper's raw ones dotted beside them; and its gold span,
when ``gold=`` timings are given); a hover view (hover a word: its attention over time, drawn by
``static/audio_hover.js``); the encoder's self-attention with time on both axes.

Above the words, the spectrogram the model heard (``metadata["spectrogram_png"]``, kept by the
capture: the input features, or the log power of a raw waveform) on the same time axis, the
encoder's (``frames``: each position's span in seconds), each word's refined span drawn over it
(patches with gid ``span``) and its raw span faint in a lane beneath (gid ``raw-span``); a cache
without one draws none."""

from __future__ import annotations

from importlib import resources
from typing import Any

from markupsafe import Markup

TITLE = "What the transcript heard"
ORDER = 23
MAX_INPUTS = 4  # inputs drawn per cache; the rest are left out (the section says so)


def frames_meta(cache) -> dict | None:
    """The encoder's ``frames`` metadata (seconds per position, ...) when it has a usable ``hop``."""
    pos = ((cache.metadata.get("stacks") or {}).get("encoder") or {}).get("positions") or {}
    frames = pos.get("frames") if isinstance(pos, dict) else None
    return frames if isinstance(frames, dict) and frames.get("hop") else None


def timings_of(gold: Any) -> list | None:
    """``gold`` as per-input word timings (a list per input of ``(start, end)``, ``(word, start,
    end)`` or ``{"word", "start", "end"}``), or None when it is something else (word alignments)."""
    if not isinstance(gold, (list, tuple)) or not gold:
        return None
    first = gold[0]
    if not isinstance(first, (list, tuple)) or not first:
        return None
    g = first[0]
    if isinstance(g, dict):
        return list(gold) if "start" in g and "end" in g else None
    if isinstance(g, (list, tuple)) and len(g) in (2, 3):
        return list(gold) if all(isinstance(x, (int, float)) for x in g[-2:]) else None
    return None


def _word_rows(ts, b: int) -> list[dict]:
    """Input ``b``'s words with their token positions in the decoder (from the tokens table)."""
    tokens = [r for r in ts.tokens.rows if r["item"] == b]
    out, k = [], 0
    for r in ts.words.rows:
        if r["item"] != b:
            continue
        n = len(r["tokens"].split("|"))
        out.append({**r, "positions": [t["position"] for t in tokens[k : k + n]]})
        k += n
    return out


def word_attention(cache, ts, b: int, n_frames: int):
    """``[words, frames]``: per word of input ``b``, the chosen heads' cross-attention (mean over
    the heads) on the rows that predict its tokens (mean over them), over its first ``n_frames``
    audio frames."""
    import torch

    rows = []
    words = _word_rows(ts, b)
    for w in words:
        per_head = [
            cache.pattern("decoder", layer, "cross")[b, _head_index(cache, head)][
                [p - 1 for p in w["positions"]]
            ]
            for layer, head in ts.chosen
        ]
        rows.append(torch.stack(per_head).float().mean(0).mean(0)[:n_frames])
    return torch.stack(rows), words


def _head_index(cache, head: int) -> int:
    captured = cache.metadata.get("heads_captured")
    return captured.index(head) if captured else head


def spectrogram_of(cache, b: int):
    """``(uint8 [bins, columns], seconds per column, kind)`` of input ``b`` from the cache's
    ``spectrogram_png``, or None when it kept none or does not know its time step."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    pngs = cache.metadata.get("spectrogram_png") or []
    col_s = cache.metadata.get("spectrogram_hop")
    if b >= len(pngs) or not col_s:
        return None
    img = np.asarray(Image.open(io.BytesIO(base64.b64decode(pngs[b]))))
    return img, float(col_s), cache.metadata.get("spectrogram_kind") or "spectrogram"


def _raw(w: dict) -> tuple[float, float]:
    """A word's raw (Whisper's recipe) span: ``raw_start``/``raw_end`` when refined, else its own."""
    return w.get("raw_start", w["start"]), w.get("raw_end", w["end"])


def _spans_over_spectrogram(
    top, img, col_s: float, words: list[dict], end: float, kind: str, label: str
) -> None:
    """The spectrogram with each word's span over it (refined, bright, labelled) and its raw span
    (Whisper's recipe) faint in a lane beneath."""
    from matplotlib.patches import Rectangle

    from probe.report.labels import display

    top.imshow(img, aspect="auto", cmap="magma", extent=(0, img.shape[1] * col_s, 0, 1), origin="upper")
    top.set_gid("spectrogram")
    refined = any("raw_start" in w for w in words)
    for w in words:
        top.add_patch(
            Rectangle(
                (w["start"], 0.02), w["end"] - w["start"], 0.96, fill=False, ec="#7fdbff", lw=1.3, gid="span"
            )
        )
        top.text(
            (w["start"] + w["end"]) / 2,
            0.9,
            display(w["word"]),
            color="white",
            ha="center",
            va="top",
            fontsize=7,
        )
        a, e = _raw(w)
        top.add_patch(
            Rectangle((a, -0.2), e - a, 0.14, fc="#cccccc", ec="#888888", alpha=0.45, lw=0.6, gid="raw-span")
        )
    top.set_xlim(0, end)
    top.set_ylim(-0.22, 1)
    top.set_yticks([])
    what = (
        "blue: each word's refined timestamps; faint beneath: Whisper's raw ones"
        if refined
        else ("blue: each word's timestamps (Whisper's recipe, beneath too)")
    )
    top.set_title(f"{label}: what the model heard ({kind}); {what}", fontsize=9)
    top.tick_params(labelbottom=False)


def _figure(ctx, att, words, enc, hop: float, label: str, has_gold: bool, spec=None) -> str:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from probe.report.labels import display

    F = att.shape[1]
    end = F * hop
    if spec is None:
        fig, (ax, ax2) = plt.subplots(
            1, 2, figsize=(12, 0.45 * len(words) + 2.2), gridspec_kw={"width_ratios": [2.2, 1]}
        )
    else:
        fig = plt.figure(figsize=(12, 0.45 * len(words) + 3.6))
        grid = fig.add_gridspec(2, 2, width_ratios=[2.2, 1], height_ratios=[1.4, 0.45 * len(words) + 0.8])
        ax, ax2 = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[:, 1])
        top = fig.add_subplot(grid[0, 0], sharex=ax)
        img, col_s, kind = spec
        _spans_over_spectrogram(top, img, col_s, words, end, kind, label)
    ax.imshow(att.numpy(), aspect="auto", cmap="inferno", extent=(0, end, len(words) - 0.5, -0.5))
    for i, w in enumerate(words):
        a, e = _raw(w)
        if "raw_start" in w:
            ax.add_patch(
                Rectangle((a, i - 0.45), e - a, 0.9, fill=False, ec="#999999", lw=0.8, ls=":", alpha=0.7)
            )
        ax.add_patch(
            Rectangle((w["start"], i - 0.45), w["end"] - w["start"], 0.9, fill=False, ec="white", lw=1.2)
        )
        if has_gold:
            ax.add_patch(
                Rectangle(
                    (w["gold_start"], i - 0.3),
                    w["gold_end"] - w["gold_start"],
                    0.6,
                    fill=False,
                    ec="#39d353",
                    lw=1.2,
                    ls="--",
                )
            )
    ax.set_yticks(range(len(words)), [display(w["word"]) for w in words])
    ax.set_xlabel("time (s)")
    ax.set_title(
        f"{label}: cross-attention of the chosen heads; white: timestamps"
        + ("; grey dots: Whisper's raw ones" if any("raw_start" in w for w in words) else "")
        + ("; green dashes: gold" if has_gold else ""),
        fontsize=9,
    )
    ax2.imshow(enc.numpy(), cmap="viridis", extent=(0, end, end, 0))
    ax2.set_xlabel("key time (s)")
    ax2.set_ylabel("query time (s)")
    ax2.set_title("encoder self-attention, last layer, mean over heads", fontsize=9)
    fig.tight_layout()
    return ctx.figure(fig, f"{label}: cross-attention over time and encoder self-attention")


def _view(att, words, hop: float, has_gold: bool) -> dict:
    """The hover view's data: per word its attention over time in 256 steps of its own largest."""
    out = []
    for w, a in zip(words, att, strict=True):
        top = float(a.max())
        q = (a / top * 255).round().int().tolist() if top > 0 else [0] * len(a)
        item = {"w": w["word"], "s": w["start"], "e": w["end"], "max": top, "q": q}
        if "raw_start" in w:
            item.update(rs=w["raw_start"], re=w["raw_end"])
        if has_gold:
            item.update(gs=w["gold_start"], ge=w["gold_end"])
        out.append(item)
    return {"hop": hop, "frames": int(att.shape[1]), "words": out}


def build(ctx) -> dict | None:
    """Per cache of an audio encoder-decoder with frame times, per input (up to
    :data:`MAX_INPUTS`): the figure and a hover view; None when no cache is one."""
    from probe.analysis.alignment import word_timestamps
    from probe.errors import ProbeError

    gold = ctx.results.get("audio_gold")
    items, notes, left_out = [], [], 0
    multi = len(ctx.caches) > 1
    for ci, cache in enumerate(ctx.caches):
        frames = frames_meta(cache)
        if frames is None or not cache.metadata.get("target_tokens"):
            continue
        try:
            ts = word_timestamps(cache, gold=gold if ci == 0 else None)
        except ProbeError as e:
            if gold is None:
                raise
            notes.append(f"the gold timings were not used ({e})")
            ts = word_timestamps(cache)
        has_gold = ts.metrics is not None
        enc_layer = cache.pattern_layers("encoder")[-1]
        names = cache.metadata.get("audio") or []
        B = cache.n_texts
        left_out += max(0, B - MAX_INPUTS)
        for b in range(min(B, MAX_INPUTS)):
            n = int((frames.get("audio") or [frames["count"]] * B)[b])
            att, words = word_attention(cache, ts, b, n)
            enc = cache.pattern("encoder", enc_layer)[b].float().mean(0)[:n, :n]
            label = (f"cache {ci + 1}, " if multi else "") + (names[b] if b < len(names) else f"input {b}")
            ctx.progress(f"audio: {label}")
            items.append(
                {
                    "label": label,
                    "fig": _figure(
                        ctx, att, words, enc, frames["hop"], label, has_gold, spectrogram_of(cache, b)
                    ),
                    "data": _view(att, words, frames["hop"], has_gold),
                }
            )
        heads = ", ".join(f"L{layer} H{head}" for layer, head in ts.chosen)
        how = "refined on the sound (attention+energy)" if ts.refine != "none" else "Whisper's raw recipe"
        line = f"heads chosen ({ts.choice}): {heads}; timestamps: {how}"
        for name, m in (("", ts.metrics), ("Whisper's raw recipe: ", ts.raw_metrics)):
            if m:
                line += (
                    f"; {name}against the gold timings: mean boundary error {m['mean_error_ms']:.1f} ms, "
                    f"within 20 / 50 / 100 ms: {m['within_20ms']:.0%} / {m['within_50ms']:.0%} / "
                    f"{m['within_100ms']:.0%}"
                )
        notes = [line, *ts.notes, *notes]
    if not items:
        return None
    js = resources.files("probe.report").joinpath("static", "audio_hover.js").read_text("utf-8")
    has_gold = any("gs" in w for it in items for w in it["data"]["words"])
    refined = any("rs" in w for it in items for w in it["data"]["words"])
    return {
        "inputs": items,
        "notes": notes,
        "left_out": left_out,
        "has_gold": has_gold,
        "refined": refined,
        "js": Markup(js),
    }
