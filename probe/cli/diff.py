"""``probe diff``: the heads whose patterns or statistics changed most between two caches."""

from __future__ import annotations

import argparse
import shutil

from probe.cli.common import add_export_args, examples, write_exports
from probe.errors import ProbeError

KEYS = ("stack", "layer", "head", "kind")
SHOWN = (*KEYS, "n_texts", "max_abs", "mean_abs", "tv", "js", "role_a", "role_b", "d_entropy")


def cmd_diff(args: argparse.Namespace) -> int:
    import probe
    from probe.analysis.compare import DELTA_COLUMNS, PATTERN_METRICS

    ranks = (*PATTERN_METRICS, *(f"d_{m}" for m in DELTA_COLUMNS))
    if args.by is not None and args.by not in ranks:
        raise ProbeError(f"--by {args.by}: choose one of: {', '.join(ranks)}")
    if args.top < 1:
        raise ProbeError(f"--top {args.top}: give at least 1")
    c = probe.compare(args.a, args.b)
    by = args.by or ("tv" if c.compared_patterns else "d_entropy")
    top = c.top(args.top, by=by)
    print(c.summary())
    print()
    cols = SHOWN if c.compared_patterns else (*KEYS, "role_a", "role_b", *(f"d_{m}" for m in DELTA_COLUMNS))
    shown = top.select(list(cols) + ([by] if by not in cols else []))
    width = shutil.get_terminal_size((100, 24)).columns
    print(shown.to_text(max_rows=args.top, width=width, keys=KEYS))
    write_exports(c, args)
    return 0


def add_parser(sub) -> None:
    """``probe diff``."""
    p = sub.add_parser(
        "diff",
        help="the heads that changed most between two caches",
        description="Compare two caches head by head (two prompts, or a model before and after a "
        "change): per-head pattern differences where the shapes agree (max and mean |Δ|, total "
        "variation, Jensen-Shannon; definitions in probe.analysis.compare) and focus-statistic "
        "differences (B − A), then print the heads that changed most. What the caches do not "
        "share (layers, heads, texts of other lengths) is listed, not guessed.",
        epilog=examples(
            "probe diff before.safetensors after.safetensors",
            "probe diff clean.safetensors corrupted.safetensors --top 5 --by js",
            "probe diff a.safetensors b.safetensors --csv heads.csv --json diff.json",
        ),
    )
    p.add_argument("a", metavar="A", help="the first cache (.safetensors)")
    p.add_argument("b", metavar="B", help="the second cache (.safetensors)")
    p.add_argument("--top", type=int, default=10, help="heads to print (default 10)")
    p.add_argument(
        "--by",
        default=None,
        help="rank by tv (default), js, max_abs, mean_abs, or a statistic delta such as d_entropy "
        "(by absolute value; the default when no pattern could be compared)",
    )
    add_export_args(p, "every head's differences (--json also holds every statistic)")
    p.set_defaults(func=cmd_diff)
