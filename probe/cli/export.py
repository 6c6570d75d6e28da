"""``probe export``: a cache as other tools' views (BertViz, CircuitsVis)."""

from __future__ import annotations

import argparse

from probe.cli import common
from probe.cli.common import add_model_args, examples, int_list
from probe.errors import ProbeError
from probe.files import human_size


def cmd_export(args: argparse.Namespace) -> int:
    import probe
    from probe.export import bertviz_html, circuitsvis_html, write_html
    from probe.files import check_writable

    if not (args.bertviz or args.circuitsvis):
        raise ProbeError("nothing to export; give --bertviz OUT.html and/or --circuitsvis OUT.html")
    for path in (args.bertviz, args.circuitsvis):
        if path is not None:
            if not path.lower().endswith((".html", ".htm")):
                raise ProbeError(f"{path}: give an .html file name for the view")
            check_writable(path, "view.html")  # before any model runs
    inputs = list(args.inputs)
    if not inputs:
        raise ProbeError("nothing to export; give a cache file (run.safetensors) or --model NAME and a text")
    if args.model or args.hf:
        if any(i.endswith(".safetensors") for i in inputs):
            raise ProbeError("give either a cache file or --model/--hf with a text, not both")
        model, tok = common.load_model(args)
        text = inputs if len(inputs) > 1 else inputs[0]
        target = None if args.target is None else (args.target if len(args.target) > 1 else args.target[0])
        cache = probe.capture(model, text, tokenizer=tok, target=target)
    elif len(inputs) == 1 and inputs[0].endswith(".safetensors"):
        cache = probe.load(inputs[0])
    else:
        raise ProbeError("give one cache file (.safetensors), or --model NAME (or --hf PATH) with a text")
    if args.bertviz:
        path = write_html(args.bertviz, bertviz_html(cache, view=args.view, batch=args.text))
        size = human_size(path.stat().st_size)
        print(f"wrote {path} ({size}): BertViz {args.view} view; it loads its scripts from the internet")
    if args.circuitsvis:
        html = circuitsvis_html(cache, stack=args.stack, layers=args.layers, batch=args.text)
        path = write_html(args.circuitsvis, html)
        print(f"wrote {path} ({human_size(path.stat().st_size)}): CircuitsVis attention heads; works offline")
    return 0


def add_parser(sub) -> None:
    """``probe export``."""
    p = sub.add_parser(
        "export",
        help="open a cache in BertViz or CircuitsVis (HTML pages of their views)",
        description="Write a cache (or a fresh capture) as the views of BertViz (head_view or "
        "model_view; encoder, decoder and cross-attention for encoder-decoders) and CircuitsVis "
        "(attention_heads, every head named L<layer>H<head>), one text at a time, padding left "
        "out. Needs the viewers: pip install -e '.[interop]'. In Python: cache.to_bertviz(), "
        "cache.to_circuitsvis().",
        epilog=examples(
            "probe export run.safetensors --circuitsvis heads.html",
            "probe export run.safetensors --bertviz heads.html --view model",
            "probe export --model minigpt 'attention lets tokens read.' --circuitsvis cv.html",
        ),
    )
    p.add_argument(
        "inputs",
        nargs="*",
        metavar="CACHE_OR_TEXT",
        help="a cache file (.safetensors), or a text to capture with --model/--hf",
    )
    add_model_args(p, default=None)
    p.add_argument("--target", "-t", nargs="+", default=None, help="decoder text for encoder-decoders")
    p.add_argument("--bertviz", metavar="OUT.html", default=None, help="write BertViz's view here")
    p.add_argument(
        "--view",
        choices=("head", "model"),
        default="head",
        help="BertViz view: head (one layer, lines between tokens; default) or model (every layer and head)",
    )
    p.add_argument("--circuitsvis", metavar="OUT.html", default=None, help="write CircuitsVis's view here")
    p.add_argument(
        "--stack",
        choices=("encoder", "decoder"),
        default=None,
        help="CircuitsVis: the stack whose self-attention to show (default: the decoder, or the only one)",
    )
    p.add_argument(
        "--layers",
        type=int_list,
        default=None,
        metavar="L,L",
        help="CircuitsVis: these layers only (comma-separated; default: every captured layer)",
    )
    p.add_argument("--text", type=int, default=0, metavar="N", help="which text of the cache (default 0)")
    p.set_defaults(func=cmd_export)
