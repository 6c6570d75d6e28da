"""``probe serve``: a corpus run's heads and texts in a local web app."""

from __future__ import annotations

import argparse

from probe.cli import common
from probe.cli.common import add_model_args, examples


def cmd_serve(args: argparse.Namespace) -> int:
    from probe.explore.data import Explorer
    from probe.explore.server import require, serve

    require()
    Explorer(args.run_dir).close()  # a run that cannot be served is refused before the model loads
    model = tok = composition = None
    if args.model or args.hf:
        model, tok = common.load_model(args)
        if not args.no_composition:
            from probe.intervene.composition import composition as compose

            composition = compose(model).table.rows
    serve(args.run_dir, host=args.host, port=args.port, model=model, tokenizer=tok, composition=composition)
    return 0


def add_parser(sub) -> None:
    """``probe serve``."""
    p = sub.add_parser(
        "serve",
        help="explore a corpus run in the browser: every head's texts, queryable",
        description="Serve a finished corpus run (probe corpus) as a local web app: a layer x head grid "
        "coloured by any statistic, a page per head (the statistic over the texts, its top and bottom "
        "texts with the positions and keys that decide it), a page per text, and search. Read-only, "
        "bound to 127.0.0.1 unless --host says otherwise; every link holds its state. With --model, "
        "texts are captured again on demand (the full report of a text; examples the run did not keep) "
        "and head pages show Q/K/V composition. Ctrl-C stops it.",
        epilog=examples(
            "probe serve runs/smollm2/",
            "probe serve runs/smollm2/ --model smollm2  # reports and composition too",
            "probe serve runs/minigpt/ --port 0  # any free port",
        ),
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a finished corpus run (probe corpus -o RUN_DIR)")
    add_model_args(p, default=None)
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 picks a free one)")
    p.add_argument("--no-composition", action="store_true", help="with --model: skip the composition scores")
    p.set_defaults(func=cmd_serve)
