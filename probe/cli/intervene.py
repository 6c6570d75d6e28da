"""``probe ablate`` and ``probe patch``: which heads and sublayers a model needs on a text."""

from __future__ import annotations

import argparse

from probe.cli import common
from probe.cli.common import (
    add_export_args,
    add_image_args,
    add_model_args,
    examples,
    int_list,
    write_exports,
)
from probe.errors import ProbeError


def _part(p: str) -> int | str:
    return int(p) if p.lstrip("-").isdigit() else p


def parse_items(text: str | None, what: str) -> list[tuple]:
    """``"0.1,decoder.1.cross.2"`` -> ``[(0, 1), ("decoder", 1, "cross", 2)]``."""
    items = []
    for item in (text or "").replace(" ", "").split(","):
        if not item:
            continue
        parts = tuple(_part(p) for p in item.split("."))
        if len(parts) < 2:
            raise ProbeError(
                f"--{what} item {item!r}: write LAYER.{'HEAD' if what == 'heads' else 'KIND'}, e.g. 0.1"
            )
        items.append(parts)
    return items


def cmd_ablate(args: argparse.Namespace) -> int:
    import probe

    heads, subs = parse_items(args.heads, "heads"), parse_items(args.sublayers, "sublayers")
    if not heads and not subs:
        raise ProbeError(
            "nothing to ablate: give --heads LAYER.HEAD,... and/or --sublayers LAYER.attn|mlp,..."
        )
    model, tok, inputs, media = _inputs(args, args.text)
    ref = (
        None if args.reference is None else (args.reference if len(args.reference) > 1 else args.reference[0])
    )
    r = probe.ablate(
        model,
        inputs,
        heads,
        sublayers=subs,
        stack=args.stack,
        how=args.how,
        reference=ref,
        tokenizer=tok,
        target=args.target,
        **media,
    )
    print(r.table.to_text(max_rows=10_000))
    print("effect on the outputs: " + ", ".join(f"{k} {v:.4g}" for k, v in r.summary.items()))
    write_exports(r, args)
    return 0


def cmd_patch(args: argparse.Namespace) -> int:
    import probe

    if args.images:  # --clean and --corrupted are pictures (with TEXT beside them for a VLM)
        model, tok, _, media = _inputs(args, args.text, pictures=[args.clean])
    else:
        if args.text:
            raise ProbeError("a TEXT beside --clean/--corrupted is for pictures; add --images")
        (model, tok), media = common.load_model(args), {}
    r = probe.patch(
        model,
        args.clean,
        args.corrupted,
        what=args.what,
        **metric_kwargs(args),
        positions=args.positions,
        stack=args.stack,
        tokenizer=tok,
        **media,
    )
    print(r)
    write_exports(r, args)
    if args.save:
        print(f"wrote {r.save(args.save)} (for probe report CACHE --patching FILE)")
    return 0


def _inputs(args: argparse.Namespace, texts: list[str], pictures: list[str] | None = None) -> tuple:
    """``(model, tokenizer, inputs, media keywords)``: the TEXTs, or with ``--image`` (or
    ``pictures``) the pictures through the model's processor, the TEXT beside them for a
    vision-language model (``processor=``, ``text=``)."""
    pictures = pictures or getattr(args, "image", None)
    if not pictures:
        if not texts:
            raise ProbeError("nothing to run the model on; give a TEXT (or --image PATH)")
        model, tok = common.load_model(args)
        return model, tok, texts if len(texts) > 1 else texts[0], {}
    model, tok, processor = common.load_image_model(args, text=bool(texts))
    media: dict = {"processor": processor}
    if texts:
        media["text"] = texts if len(texts) > 1 else texts[0]
    return model, tok, pictures, media


def _tok(t: str | None) -> int | str | None:
    """``--answer 17`` is token id 17 with ``--ids``-style input; a quoted string is a token."""
    if t is not None and t.startswith("id:"):
        try:
            return int(t[3:])
        except ValueError:
            raise ProbeError(f"{t!r}: write id:NUMBER for a token id") from None
    return t


def add_metric_args(p: argparse.ArgumentParser, default: str, what: str = "") -> None:
    """``--metric`` (logit_diff, prob, loss), ``--answer`` and ``--wrong``."""
    p.add_argument(
        "--metric",
        choices=("logit_diff", "prob", "loss"),
        default=default,
        help=f"{what}the metric: logit_diff (--answer minus --wrong at the last token), prob (of --answer) "
        f"or loss (next-token); default {default}",
    )
    p.add_argument("--answer", default=None, help="the answer token (a one-token string, or id:N)")
    p.add_argument("--wrong", default=None, help="the wrong token for logit_diff (string or id:N)")


def metric_kwargs(args: argparse.Namespace) -> dict:
    """``metric=``, ``answer=``, ``wrong=`` from the flags, refused (exit 2) where one is missing."""
    if args.metric == "logit_diff" and (args.answer is None or args.wrong is None):
        raise ProbeError("--metric logit_diff needs --answer and --wrong (one-token strings or id:N)")
    if args.metric == "prob" and args.answer is None:
        raise ProbeError("--metric prob needs --answer (a one-token string or id:N)")
    return {"metric": args.metric, "answer": _tok(args.answer), "wrong": _tok(args.wrong)}


def add_parsers(sub) -> None:
    """``probe ablate`` and ``probe patch``."""
    _ablate_parser(sub)
    _patch_parser(sub)


def _ablate_parser(sub) -> None:
    p = sub.add_parser(
        "ablate",
        help="remove heads or sublayers and see how the model's outputs change",
        description="Run a model on a text with attention heads (their slice of the output "
        "projection's input) or whole sublayers (their write to the residual stream) replaced by "
        "zeros, their mean over a reference, or their value on a reference text; print what was "
        "removed and the effect on the outputs (max |change|, mean KL, top-1 agreement).",
        epilog=examples(
            'probe ablate --model minigpt "attention lets tokens read" --heads 0.1,1.3',
            'probe ablate --model minigpt "attention lets" --sublayers 1.mlp --how mean '
            '--reference "graph neural"',
            "probe ablate --model vit_zoo --image ring.png --heads 3.0,3.1",
            "probe ablate --hf ./my-llava --image cat.png 'USER: <image> what is it?' "
            "--heads language_model.layers.1.2",
        ),
    )
    p.add_argument(
        "text", nargs="*", metavar="TEXT", help="input text(s); with --image, the text beside the pictures"
    )
    add_model_args(p)
    add_image_args(
        p, "a picture to run the model on (several = one batch); --reference then takes pictures too"
    )
    p.add_argument(
        "--heads",
        default=None,
        help="heads to remove: LAYER.HEAD[,...] (or STACK.LAYER.HEAD, STACK.LAYER.cross.HEAD)",
    )
    p.add_argument("--sublayers", default=None, help="sublayers to remove: LAYER.attn|cross_attn|mlp[,...]")
    p.add_argument("--stack", default=None, help="the stack (encoder/decoder) for items without one")
    p.add_argument(
        "--how", choices=("zero", "mean", "resample"), default="zero", help="replacement (default zero)"
    )
    p.add_argument("--reference", nargs="+", default=None, help="reference text(s) for --how mean/resample")
    p.add_argument("--target", "-t", nargs="+", default=None, help="decoder text for encoder-decoders")
    add_export_args(p, "the table of removed components")
    p.set_defaults(func=cmd_ablate)


def _patch_parser(sub) -> None:
    p = sub.add_parser(
        "patch",
        help="activation patching: which layers, positions or heads carry the difference of two texts",
        description="Run a model on a clean and a corrupted text of the same length; for each layer "
        "and position (--what resid/attn/mlp) or layer and head (--what heads) put the clean "
        "activation into the corrupted run and report the metric, normalised so that 1 = clean, "
        "0 = corrupted.",
        epilog=examples(
            'probe patch --model minigpt --clean "attention lets tokens read" '
            '--corrupted "attention lets tokens send" --answer " " --wrong t',
            'probe patch --model minigpt --clean "attention lets" --corrupted "attention sets" '
            "--what heads --metric loss",
            "probe patch --model vit_zoo --images --clean ring.png --corrupted square.png --metric prob "
            "--answer ring",
        ),
    )
    p.add_argument(
        "text", nargs="*", metavar="TEXT", help="with --images: the text beside the pictures (a VLM)"
    )
    add_model_args(p)
    p.add_argument("--clean", required=True, help="the clean text (with --images: a picture file)")
    p.add_argument(
        "--corrupted",
        required=True,
        help="the corrupted text (same number of tokens; with --images: a picture)",
    )
    p.add_argument(
        "--images",
        action="store_true",
        help="--clean and --corrupted are picture files, through the model's processor",
    )
    p.add_argument(
        "--processor", default=None, metavar="PATH", help="the image processor (default: the --hf folder's)"
    )
    p.add_argument(
        "--what",
        choices=("resid", "heads", "attn", "mlp"),
        default="resid",
        help="what to patch (default resid)",
    )
    add_metric_args(p, "logit_diff")
    p.add_argument(
        "--positions", type=int_list, default=None, help="positions to patch, e.g. 0,3,-1 (default all)"
    )
    p.add_argument("--stack", default=None, help="the stack to patch (encoder/decoder)")
    add_export_args(p, "the table of patches")
    p.add_argument(
        "--save",
        default=None,
        metavar="FILE",
        help="save the whole result as JSON for probe report --patching",
    )
    p.set_defaults(func=cmd_patch)
