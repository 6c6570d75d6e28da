"""``docs/catalogue.md`` from the sweep's JSON results (``benchmarks/catalogue.py --markdown``)."""

from __future__ import annotations

import platform

ORDER = (
    "exact",
    "wrong",
    "crash",
    "timeout",
    "refused",
    "no softmax attention",
    "cannot run",
    "run failed",
    "build failed",
    "needs a library",
    "sub-config",
    "no model class",
)
MEANING = {
    "exact": "every stored pattern within 1e-5 of eager `output_attentions` (or, where eager differs "
    "or returns nothing, of a softmax of the arguments handed to SDPA), real query rows",
    "wrong": "a pattern differs from both oracles, or the counts/shapes disagree",
    "crash": "an exception other than `ProbeError` inside probe",
    "timeout": "no verdict within the per-model timeout",
    "refused": "probe raised `ProbeError` (the reason is its message)",
    "no softmax attention": "probe found no attention, and neither eager nor SDPA has any",
    "cannot run": "the model takes inputs other than token ids, pictures and audio (video, a time series, "
    "layout boxes, ...; the reason names them): not run",
    "run failed": "the tiny model's forward fails without probe (the shrunk config, or the inputs made "
    "from it, do not suit it)",
    "build failed": "no tiny config/model could be built from the generic shrink and the overrides",
    "needs a library": "the modeling code needs an optional library that is not installed here (the reason "
    "names it); not a failure of the shrink or of probe",
    "sub-config": "a part of another family (a vision tower, a codec, one stack of an encoder-decoder) with "
    "no model class of its own; transformers builds it inside the parent named in the reason, whose own "
    "row is its verdict",
    "no model class": "no auto mapping of transformers pairs the config with a model class that can be "
    "imported, and no other config holds it",
}


def _fmt(x) -> str:
    return "" if x is None else f"{x:.1e}"


def _cell(s: str, n: int = 400) -> str:
    s = " ".join(str(s).split()).replace("|", "\\|")
    return s if len(s) <= n else s[: n - 1] + "…"


RAN = ("exact", "wrong", "crash", "refused", "no softmax attention")


def _inputs(v: dict) -> str:
    """What the model ran on, in a few words: ids, or the image inputs' shapes."""
    if v.get("inputs") == "text only":
        return "ids (text only)"
    if v.get("inputs"):
        return _cell(v["inputs"], 200)
    if v.get("image"):
        return "pixels (not run)"
    if v.get("audio"):
        return "audio (not run)"
    return "ids" if v.get("status") in RAN else ""


def _cause(mt: str, v: dict) -> str:
    """The verdict's reason, with the diagnosed cause first where there is one."""
    from catalogue_diagnosis import CAUSES

    why = v.get("reason", "")
    return f"**cause:** {CAUSES[mt]}. {why}" if mt in CAUSES and v["status"] != "exact" else why


def page(data: dict[str, dict]) -> str:
    """The markdown page: what was run, the counts, and one row per model type."""
    import torch
    import transformers

    counts = {s: 0 for s in ORDER}
    images = {s: 0 for s in ORDER}
    audio = {s: 0 for s in ORDER}
    for v in data.values():
        counts[v["status"]] = counts.get(v["status"], 0) + 1
        images[v["status"]] = images.get(v["status"], 0) + bool(v.get("image"))
        audio[v["status"]] = audio.get(v["status"], 0) + bool(v.get("audio"))
    lines = [
        "# The catalogue sweep",
        "",
        f"Every model type of the installed `transformers` ({transformers.__version__}; torch "
        f"{torch.__version__}, {platform.machine()}, float32, CPU), built from a shrunk config (hidden "
        "size 64, two layers or one of each layer type, four heads, two key-value heads, vocabulary 512; "
        "sizes that a config validator ties to one another set as its message says; per-family overrides "
        "in `tests/catalogue_overrides.py`), run on random ids `[2, 8]` with the "
        "second row padded after five tokens (encoder-decoders also get random decoder ids `[2, 6]`), "
        "captured by probe on the default attention implementation and compared with eager "
        "`output_attentions` of the same weights, and with a softmax of the arguments the model "
        "hands to `scaled_dot_product_attention` where eager returns nothing or differs. The "
        "comparison is `tests/catalogue_check.py`; `tests/test_catalogue.py` runs it in CI on a "
        "fixed sample.",
        "",
        "Image and vision-language families (those whose forward takes `pixel_values`) are run on "
        "inputs made from their own shrunk config by `tests/catalogue_inputs.py`: random pixels at the "
        "config's image size and channel count (64×96 where the config names no size), one image for "
        "a vision model and one per row for a model that also reads text; a `pixel_mask` of ones where "
        "the forward takes one; Qwen2-VL-style towers get flattened patches with an `image_grid_thw` of "
        "a 2m × 3m patch grid (m the merge size); a vision-language model's text is random ids `[2, n + 8]` "
        "with one run of `n` image tokens (the config's image token id, after a vision-start token where "
        "the config has one), `n` the count its config states or its patch grid, corrected to the number "
        "of image features the forward reports; the second row padded after its last three words. Where "
        "a forward refuses 4-d pixels, one image per row as `[batch, 1, C, H, W]` is used, and "
        "`image_sizes` where it asks for them. The pixels go through `probe.capture(model, inputs)` (the "
        "keyword-inputs path that names patch positions). A vision-language model whose forward refuses "
        "these inputs is checked on text ids as before, and the row says why (`text only`). Such models' "
        "eager outputs hold part of their attentions (a vision-language model's language model only), so "
        "the check adds two oracles (`tests/catalogue_oracles.py`): the weights of every "
        "`nn.MultiheadAttention` call recomputed by a hook (SigLIP's pooling head) and every softmax of the "
        "eager forward; per-picture SDPA calls of a packed tower are joined block-diagonally. A row is "
        "then exact when every pattern that eager, SDPA or the hook returns is stored and every stored "
        "pattern equals one of theirs or one of the eager softmaxes (the note says `every stored pattern "
        "equals one of the oracles'`).",
        "",
        "Audio families (those whose forward's main input is a spectrogram or a waveform, "
        "`input_features`, `input_values` or `audio_mel`, and no token ids) are run on inputs made from "
        "their shrunk config by `tests/catalogue_audio.py`: two random spectrograms `[2, mel bins, "
        "frames]` (or `[2, frames, mel bins]`, frames stacked as wide as the config's input projection, "
        "`[2, 1, frames, mel bins]`, whichever the forward takes) at the length the config fixes "
        "(Whisper-style encoders: 2 · `max_source_positions` frames, 32 positions in the shrunk "
        "configs; Qwen3-ASR: whole windows; else 128 frames), or two random waveforms long enough for "
        "16 frames of the convolution feature extractor (its kernels and strides) or of a codec's "
        "down-sampling; an attention mask over the input with the second row's last quarter padded "
        "where the forward takes one and runs with it; random decoder ids `[2, 6]` for an "
        "encoder-decoder. They go through `probe.capture(model, inputs)` as the pictures do. Where eager "
        "returns a layer's weights averaged over the heads (WavLM), the stored patterns' head means "
        "are compared with eager and each head with the eager forward's own softmax.",
        "",
        "A few model types run in seconds (`--only`, comma-separated; `--jobs`, `--timeout` and "
        "`--out` as `--help` says; a rerun resumes the JSON file, `--redo` reruns what is there):",
        "",
        "```console",
        "$ python benchmarks/catalogue.py --only gpt2 --out few.json",
        "...",
        "```",
        "",
        "The whole catalogue, image and audio families included, takes 4 to 25 minutes on two cores "
        "(measured: 3 min 36 s with the cores to itself before the audio families were run; 20 min 58 s "
        "with them, beside other work at a load average of 12 to 16), "
        "in worker processes with a per-model timeout; this page is generated from its JSON "
        "(`benchmarks/catalogue.json`):",
        "",
        "<!-- no-run: 4 to 25 minutes on two cores -->",
        "```console",
        "$ nice -n 19 python benchmarks/catalogue.py --out benchmarks/catalogue.json --jobs 2 --timeout 300",
        "$ python benchmarks/catalogue.py --markdown benchmarks/catalogue.json > docs/catalogue.md",
        "```",
        "",
        "The hand-written tests of individual architectures, with the deviations of deltas and the "
        "chain as well as patterns, are the table in "
        "[Tested architectures](frameworks.md#tested-architectures).",
        "",
        "## Counts",
        "",
        "The column *image* counts the image and vision-language families among them (forward takes "
        "`pixel_values`); *text only* those of them checked on text ids because their forward refused "
        "the image inputs; *audio* the audio families (run on a spectrogram or a waveform).",
        "",
        "| verdict | model types | image | text only | audio | meaning |",
        "|---|---|---|---|---|---|",
    ]
    text_only = {
        st: sum(v["status"] == st and v.get("inputs") == "text only" for v in data.values()) for st in counts
    }
    lines += [
        f"| {st} | {counts[st]} | {images[st]} | {text_only[st]} | {audio[st]} | {MEANING.get(st, '')} |"
        for st in counts
        if counts[st] or st in MEANING
    ]
    total_img = sum(images.values())
    total_audio = sum(audio.values())
    lines += [f"| total | {len(data)} | {total_img} | {sum(text_only.values())} | {total_audio} | |", ""]
    for s in ORDER:
        rows = sorted((mt, v) for mt, v in data.items() if v["status"] == s)
        if not rows:
            continue
        lines += [f"## {s} ({len(rows)})", ""]
        if s in ("exact", "wrong"):
            lines += [
                "| model type | class | inputs | patterns | vs eager | vs SDPA | note |",
                "|---|---|---|---|---|---|---|",
            ]
            for mt, v in rows:
                v = {**v, "reason": _cause(mt, v)}
                plain = s == "exact" and v.get("oracle") == "eager" and "eager_other" not in v
                note = "" if plain else v.get("reason", "")
                if (v.get("pad_diff") or 0) > 1e-5:
                    note = f"padded query rows differ by {v['pad_diff']:.1e}; " + note
                if v.get("image_failed"):
                    what = "audio" if v.get("audio") else "image"
                    note = f"{what} inputs refused by the forward ({v['image_failed']}); " + note
                lines.append(
                    f"| `{mt}` | {v.get('class', '')} | {_inputs(v)} | {v.get('n_probe', '')} "
                    f"| {_fmt(v.get('eager_diff'))} | {_fmt(v.get('sdpa_diff'))} | {_cell(note)} |"
                )
        else:
            lines += ["| model type | class | inputs | reason |", "|---|---|---|---|"]
            lines += [
                f"| `{mt}` | {v.get('class', '')} | {_inputs(v)} | {_cell(_cause(mt, v), 400)} |"
                for mt, v in rows
            ]
        lines.append("")
    return "\n".join(lines)
