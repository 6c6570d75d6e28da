"""``probe stats``: per-head focus statistics of a cache, or over texts captured from a model."""

from __future__ import annotations

import argparse
import shutil

from probe.cli import common
from probe.cli.common import add_model_args, examples
from probe.errors import ProbeError
from probe.files import input_file


def cmd_stats(args: argparse.Namespace) -> int:
    from probe.analysis.focus import METRICS, head_stats

    if args.sort not in METRICS:
        raise ProbeError(f"--sort {args.sort}: not a metric; choose one of: {', '.join(METRICS)}")
    if args.path and (args.model or args.hf or args.texts):
        raise ProbeError("give either a cache file or --model/--hf with --texts, not both")
    if args.path:
        caches = [args.path]
    else:
        if not args.texts:
            raise ProbeError("give a cache file, or --texts FILE (one text per line) with --model/--hf")
        caches = _text_caches(args)
    stats = head_stats(caches, progress=not args.json)
    table = stats.table.sorted(args.sort, descending=not args.ascending)
    if args.csv:
        stats.to_csv(args.csv)
    if args.json:
        print(stats.to_json())
    else:
        print(stats.summary())
        shown = table.select(_columns(args.columns, table.columns, args.sort))
        width = args.width if args.width is not None else shutil.get_terminal_size((100, 24)).columns
        print(shown.to_text(max_rows=args.rows, width=width or None, keys=KEYS))
        if len(shown.columns) < len(table.columns):
            print(f"({len(table.columns) - len(shown.columns)} more columns: --columns all, or --csv/--json)")
        if args.csv:
            print(f"wrote {args.csv}")
    return 0


KEYS = ("stack", "layer", "head", "kind")
# what `probe stats` prints by default; every column is in --csv/--json and --columns all
DEFAULT_COLUMNS = (
    *KEYS,
    "role",
    "entropy",
    "norm_entropy",
    "confidence",
    "first",
    "prev",
    "self",
    "next",
    "distance",
    "span",
    "pos_frac",
    "induction_prefix",
)


def _columns(spec: str | None, have: list[str], sort: str) -> list[str]:
    """The columns to print: ``--columns all``, a comma list, or the defaults (plus the sort
    metric); each metric followed by its ``_std`` column when there is one."""
    if spec == "all":
        return list(have)
    if spec:
        want = [c.strip() for c in spec.split(",") if c.strip()]
        bad = [c for c in want if c not in have]
        if bad:
            raise ProbeError(f"--columns: no column {', '.join(bad)}; the table has: {', '.join(have)}")
    else:
        want = list(DEFAULT_COLUMNS) + ([sort] if sort not in DEFAULT_COLUMNS else [])
    out = []
    for c in want:
        out.append(c)
        if f"{c}_std" in have and f"{c}_std" not in want:
            out.append(f"{c}_std")
    return [c for c in out if c in have]


def _text_caches(args: argparse.Namespace):
    """Captures of the texts in ``--texts`` (one per line), ``--batch`` at a time, lazily."""
    from probe import forward

    path = input_file(args.texts, "--texts", "give a text file with one text per line")
    texts = [t for t in path.read_text(encoding="utf-8").splitlines() if t.strip()]
    if not texts:
        raise ProbeError(f"--texts {args.texts}: the file has no texts (one per line)")
    model, tok = common.load_model(args)

    class _Batches:
        def __len__(self) -> int:
            return (len(texts) + args.batch - 1) // args.batch

        def __iter__(self):
            for i in range(0, len(texts), args.batch):
                yield forward.capture(model, texts[i : i + args.batch], tokenizer=tok)

    return _Batches()


def add_parser(sub) -> None:
    """``probe stats``."""
    p = sub.add_parser(
        "stats",
        help="per-head focus statistics and roles",
        description="Per-head focus statistics (entropy, confidence, offsets, sink, distance, span, "
        "templates, roles; definitions in probe.analysis.focus) of a cache, or mean ± std over texts "
        "captured from a model.",
        epilog=examples(
            "probe stats run.safetensors --sort entropy --csv heads.csv",
            "probe stats run.safetensors --columns layer,head,role,first,prev",
            "probe stats --model minigpt --texts texts.txt",
        ),
    )
    p.add_argument("path", nargs="?", default=None, help="a .safetensors cache written by probe")
    add_model_args(p, default=None)
    p.add_argument("--texts", metavar="FILE", default=None, help="texts to capture, one per line")
    p.add_argument("--batch", type=int, default=8, help="texts per forward pass with --texts (default 8)")
    p.add_argument("--sort", default="entropy", help="metric to sort by (default: entropy)")
    p.add_argument("--ascending", action="store_true", help="smallest first")
    p.add_argument("--rows", type=int, default=40, help="rows to print (default 40)")
    p.add_argument(
        "--columns",
        metavar="COLS",
        default=None,
        help="columns to print: comma-separated names, or 'all' (default: layer, head, role and the "
        "main metrics; --csv/--json always hold every column)",
    )
    p.add_argument(
        "--width",
        type=int,
        default=None,
        help="wrap the table into blocks of columns at most this wide (default: the terminal's; 0: never)",
    )
    p.add_argument("--csv", metavar="OUT", default=None, help="also write the table as CSV")
    p.add_argument("--json", action="store_true", help="print JSON instead of the text table")
    p.set_defaults(func=cmd_stats)
