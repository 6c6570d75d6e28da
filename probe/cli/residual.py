"""``probe residual``, ``probe lens`` and ``probe budget``: the residual stream and the model's anatomy."""

from __future__ import annotations

import argparse

from probe.cli import common
from probe.cli.common import add_export_args, add_model_args, examples, write_exports
from probe.errors import ProbeError


def cmd_residual(args: argparse.Namespace) -> int:
    import probe

    stats = probe.residual(probe.load(args.path))
    print(stats.layers.to_text(max_rows=10_000))
    for n in stats.notes:
        print(f"note: {n}")
    write_exports(stats.tokens if args.tokens else stats.layers, args)
    return 0


def cmd_lens(args: argparse.Namespace) -> int:
    import probe

    model, tok = common.load_model(args)
    text = args.text if len(args.text) > 1 else args.text[0]
    lens = probe.logit_lens(model, text, tokenizer=tok, target=args.target, k=args.k)
    print(f"read-out: {lens.readout}; last layer vs the model's logits: max |diff| {lens.final_error:.2e}")
    print("top-1 token and p(final prediction) per layer (rows) and position (columns):")
    import shutil

    print(lens.to_text(0, width=shutil.get_terminal_size((100, 24)).columns))
    for n in lens.notes:
        print(f"note: {n}")
    att = lens.attribution
    if att is not None:
        pos = args.position
        T = int(lens.mask[0].sum())
        if not -T <= pos < T:
            raise ProbeError(f"--position {pos} is outside the text's {T} tokens")
        pos = pos % T
        pred = lens.token(int(lens.predicted[0, pos]))
        print(
            f"\ndirect logit attribution of {pred!r} at position {pos} ({lens.tokens[0][pos]!r}), "
            f"final norm's scale frozen; sum vs logit: max |diff| {att.max_error:.2e}"
        )
        for name, v in att.bars(0, pos) + att.bars(0, pos, heads=True):
            print(f"  {name:30} {v:+9.4f}")
        print(f"  {'(norm bias + unembedding bias)':30} {att.constant[0, pos].item():+9.4f}")
        print(f"  {'= logit':30} {att.logit[0, pos].item():+9.4f}")
        for n in att.notes:
            print(f"note: {n}")
    write_exports(lens, args)
    return 0


def cmd_budget(args: argparse.Namespace) -> int:
    import probe

    if args.config and (args.model or args.hf):
        raise ProbeError("give one of --model, --hf or --config, not several")
    if args.config:
        b = probe.budget(args.config)
    else:
        model, _ = common.load_model(args)
        b = probe.budget(model)
    print(b.to_text())
    if args.layers:
        print(b.by_layer.to_text(max_rows=10_000))
    write_exports(b, args)
    return 0


def add_parsers(sub) -> None:
    """``probe residual``, ``probe lens`` and ``probe budget``."""
    p = sub.add_parser(
        "residual",
        help="residual-stream statistics of a cache (|E|, |ΔE|, ratio, cosine per sublayer)",
        description="Per layer and sublayer: the mean |E| and |ΔE| (L2), |ΔE|/|E|, cos(ΔE, E) and how "
        "often the sublayer writes most, from a cache written by `probe capture`.",
        epilog=examples("probe residual run.safetensors --csv residual.csv"),
    )
    p.add_argument("path", help="a .safetensors cache written by probe")
    p.add_argument("--tokens", action="store_true", help="export one row per token instead of per layer")
    add_export_args(p, "the table")
    p.set_defaults(func=cmd_residual)

    p = sub.add_parser(
        "lens",
        help="logit lens and direct logit attribution of a model on a text",
        description="Read every layer's residual stream through the model's own final norm and "
        "unembedding (the logit lens), and split the predicted token's logit among the embedding, "
        "each sublayer and each head (direct logit attribution, final norm's scale frozen).",
        epilog=examples('probe lens --model minigpt "attention lets tokens read"'),
    )
    p.add_argument("text", nargs="+", metavar="TEXT", help="input text (the first is shown)")
    add_model_args(p)
    p.add_argument("--target", "-t", nargs="+", default=None, help="decoder text for encoder-decoders")
    p.add_argument("-k", type=int, default=5, help="top-k tokens per cell in the exports (default 5)")
    p.add_argument("--position", type=int, default=-1, help="position to attribute (default: the last)")
    add_export_args(p, "the lens table")
    p.set_defaults(func=cmd_lens)

    p = sub.add_parser(
        "budget",
        help="where a model's parameters live (embedding, W_Q/K/V/O, MLP, norms, ...)",
        description="Count a model's parameters by role and layer from its module tree; tied weights "
        "counted once. --config builds a Hugging Face config on the meta device (no memory); "
        "--config gpt3 is the tutorial's GPT-3 (175B).",
        epilog=examples("probe budget --model translator", "probe budget --config gpt3"),
    )
    add_model_args(p, default="minigpt")
    p.add_argument("--config", default=None, metavar="FILE", help="a config.json, or the preset gpt3")
    p.add_argument("--layers", action="store_true", help="also print the per-layer table")
    add_export_args(p, "the by-role table")
    p.set_defaults(func=cmd_budget)
