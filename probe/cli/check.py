"""``probe check``: the causal- and padding-mask audit (exit 0 causal, 1 leak, 2 bad input)."""

from __future__ import annotations

import argparse

from probe.cli import common
from probe.cli.common import add_model_args, examples
from probe.errors import ProbeError


def cmd_check(args: argparse.Namespace) -> int:
    """``probe check``: the causal-mask audit; exit 0 when causal, 1 when a leak is found."""
    import probe

    expect = args.expect
    if expect is not None and expect.isdigit():
        expect = int(expect)
    inputs = list(args.inputs)
    if len(inputs) == 1 and inputs[0].endswith(".safetensors"):
        if args.model or args.hf:
            raise ProbeError("give either a cache file or --model/--hf with text, not both")
        report = probe.check_causal(probe.load(inputs[0]), expect=expect)
    else:
        if any(t.endswith(".safetensors") for t in inputs):
            raise ProbeError("give one cache file alone (probe check run.safetensors)")
        model, tok = common.load_model(args)
        text = None if not inputs else (inputs if len(inputs) > 1 else inputs[0])
        report = probe.check_causal(model, text, tokenizer=tok, expect=expect)
    if args.json:
        print(report.to_json())
    else:
        print(report)
    return 0 if report.ok else 1


def add_parser(sub) -> None:
    """``probe check``."""
    p = sub.add_parser(
        "check",
        help="audit a model's causal and padding masks (exit 0 causal, 1 leak, 2 bad input)",
        description="Prove a model never attends to the future or to padding, or show where it does: "
        "static checks on the captured patterns, then (with a model) suffix perturbation, input "
        "gradients, padding parity, KV-cache decoding and eager-vs-SDPA parity.",
        epilog=examples(
            "probe check --model minigpt 'attention lets tokens read.'",
            "probe check run.safetensors --expect causal",
            "probe check --hf ./my-model 'some text'",
        ),
    )
    p.add_argument("inputs", nargs="*", metavar="TEXT|CACHE", help="text(s) for the model, or one cache file")
    add_model_args(p)
    p.add_argument(
        "--expect",
        default=None,
        help="what attention should be: causal, bidirectional, or a sliding-window size (default: inferred)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_check)
