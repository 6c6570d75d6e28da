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
    "cannot run on text",
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
    "cannot run on text": "the model does not run on token ids alone (it asks for pixel, audio or other "
    "inputs)",
    "run failed": "the tiny model's forward fails without probe (the shrunk config does not suit it)",
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
    for v in data.values():
        counts[v["status"]] = counts.get(v["status"], 0) + 1
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
        "A few model types run in seconds (`--only`, comma-separated; `--jobs`, `--timeout` and "
        "`--out` as `--help` says; a rerun resumes the JSON file, `--redo` reruns what is there):",
        "",
        "```console",
        "$ python benchmarks/catalogue.py --only gpt2 --out few.json",
        "...",
        "```",
        "",
        "The whole catalogue takes about a quarter of an hour on two cores (measured: 11 minutes), "
        "in worker processes with a per-model timeout; this page is generated from its JSON "
        "(`benchmarks/catalogue.json`):",
        "",
        "<!-- no-run: a quarter of an hour on two cores -->",
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
        "| verdict | model types | meaning |",
        "|---|---|---|",
    ]
    lines += [f"| {s} | {counts[s]} | {MEANING.get(s, '')} |" for s in counts if counts[s] or s in MEANING]
    lines += [f"| total | {len(data)} | |", ""]
    for s in ORDER:
        rows = sorted((mt, v) for mt, v in data.items() if v["status"] == s)
        if not rows:
            continue
        lines += [f"## {s} ({len(rows)})", ""]
        if s in ("exact", "wrong"):
            lines += [
                "| model type | class | patterns | vs eager | vs SDPA | note |",
                "|---|---|---|---|---|---|",
            ]
            for mt, v in rows:
                v = {**v, "reason": _cause(mt, v)}
                plain = s == "exact" and v.get("oracle") == "eager" and "eager_other" not in v
                note = "" if plain else v.get("reason", "")
                if (v.get("pad_diff") or 0) > 1e-5:
                    note = f"padded query rows differ by {v['pad_diff']:.1e}; " + note
                lines.append(
                    f"| `{mt}` | {v.get('class', '')} | {v.get('n_probe', '')} | {_fmt(v.get('eager_diff'))} "
                    f"| {_fmt(v.get('sdpa_diff'))} | {_cell(note)} |"
                )
        else:
            lines += ["| model type | class | reason |", "|---|---|---|"]
            lines += [f"| `{mt}` | {v.get('class', '')} | {_cell(_cause(mt, v), 400)} |" for mt, v in rows]
        lines.append("")
    return "\n".join(lines)
