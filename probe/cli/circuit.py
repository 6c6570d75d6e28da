"""``probe circuit``: which edges between heads and MLPs carry the difference of two sets of prompts."""

from __future__ import annotations

import argparse
from pathlib import Path

from probe.cli import common
from probe.cli.common import add_model_args, examples
from probe.errors import ProbeError


def _lines(path: str, what: str) -> list[str]:
    """The non-empty lines of a UTF-8 text file (each a prompt), without their line ends."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ProbeError(f"{what} file {path} does not exist") from None
    except UnicodeDecodeError:
        raise ProbeError(f"{what} file {path} is not UTF-8 text") from None
    lines = [ln.rstrip("\r") for ln in text.split("\n")]
    lines = [ln for ln in lines if ln.strip()]
    if not lines:
        raise ProbeError(f"{what} file {path} has no prompts (one per line)")
    return lines


def token(text: str) -> int | str:
    """A one-token string as written, or ``id:N`` for token id N."""
    if text.startswith("id:"):
        try:
            return int(text[3:])
        except ValueError:
            raise ProbeError(f"{text!r}: write id:NUMBER for a token id") from None
    return text


def counts(text: str) -> list[int]:
    """``"1,5,10"`` -> ``[1, 5, 10]`` (edge counts for the curve)."""
    try:
        out = [int(p) for p in text.replace(" ", "").split(",") if p]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected edge counts like 1,5,10, got {text!r}") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected edge counts like 1,5,10, got {text!r}")
    return out


def answers_of(args: argparse.Namespace, n: int):
    """``answers=`` from ``--answers CORRECT [WRONG]`` or ``--answers-file`` (one line per prompt:
    the correct token, a tab, the wrong token)."""
    if args.answers and args.answers_file:
        raise ProbeError("give --answers or --answers-file, not both")
    if args.answers_file:
        rows = [ln.split("\t") for ln in _lines(args.answers_file, "--answers-file")]
        if len(rows) != n or any(len(r) not in (1, 2) for r in rows):
            raise ProbeError(f"--answers-file needs one line per prompt ({n}): CORRECT, or CORRECT<TAB>WRONG")
        return [tuple(token(t) for t in r) for r in rows]
    if not args.answers:
        return None
    if len(args.answers) > 2:
        raise ProbeError(
            "--answers takes CORRECT [WRONG] for every prompt; use --answers-file for one per prompt"
        )
    got = tuple(token(t) for t in args.answers)
    return got if len(got) == 2 else got[0]


def _report(args: argparse.Namespace, model, tok, clean: list[str], c, curve) -> None:
    """``--report DIR``: the report of the clean prompts' capture, with the circuit's section (its
    curve: ``--curve``'s, else the report's default counts)."""
    import probe
    from probe.files import human_size

    cache = probe.capture(model, clean, tokenizer=tok)
    path = probe.report([cache], args.report, model=model, tokenizer=tok, circuit=c, circuit_curve=curve)
    size = human_size(path.stat().st_size)
    print(f"wrote {path} ({size}); open it in a browser: {path.resolve().as_uri()}")


def cmd_circuit(args: argparse.Namespace) -> int:
    import probe

    if args.report is not None:  # a file there, or no permission: refused before any work
        from probe.report.html import check_report_dir

        check_report_dir(args.report)
    clean, corrupted = _lines(args.clean, "--clean"), _lines(args.corrupted, "--corrupted")
    if len(clean) != len(corrupted):
        raise ProbeError(f"--clean has {len(clean)} prompts but --corrupted {len(corrupted)}; give one each")
    answers = answers_of(args, len(clean))
    model, tok = common.load_model(args)
    c = probe.circuit(
        model,
        clean,
        corrupted,
        metric=args.metric,
        answers=answers,
        method=args.method,
        steps=args.steps,
        batch_size=args.batch_size,
        tokenizer=tok,
    )
    print(c.summary())
    print(c.table.top("rank", args.top, descending=False).to_text(max_rows=args.top))
    curve = None
    if args.curve:
        curve = c.evaluate(args.curve, how=args.how)
        print()
        print(curve)
    for fmt, what in (("json", "the graph and every edge's score"), ("csv", "the table of edges")):
        path = getattr(args, fmt)
        if path:
            getattr(c, f"to_{fmt}")(path)
            print(f"wrote {path} ({what})")
    if args.report is not None:
        _report(args, model, tok, clean, c, curve)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "circuit",
        help="score every edge between heads and MLPs on clean vs corrupted prompts (EAP, EAP-IG, patching)",
        description="Score every edge of the model's graph (the embedding, each head's query, key and "
        "value inputs, each MLP, the logits) by how much the metric drops when that edge reads the "
        "corrupted run instead of the clean one: edge attribution patching (eap), EAP with integrated "
        "gradients (eap-ig) or exact patching. Prompts: one per line, the corrupted ones with the same "
        "number of tokens. Prints the top edges and, with --curve, the faithfulness of circuits of "
        "that many edges (the model run with every other edge corrupted).",
        epilog=examples(
            "probe circuit --model induction --clean clean.txt --corrupted corrupted.txt "
            "--answers-file answers.tsv --metric logit-diff",
            "probe circuit --hf ./SmolLM2 --clean ioi.txt --corrupted ioi_swapped.txt "
            "--answers-file names.tsv --method eap --curve 10,100,1000 --json graph.json --csv edges.csv",
            "probe circuit --model induction --clean clean.txt --corrupted corrupted.txt "
            "--answers-file answers.tsv --report reports/induction-circuit",
        ),
    )
    add_model_args(p)
    p.add_argument("--clean", required=True, metavar="FILE", help="clean prompts, one per line (UTF-8)")
    p.add_argument("--corrupted", required=True, metavar="FILE", help="corrupted prompts, one per line")
    p.add_argument(
        "--answers",
        nargs="+",
        default=None,
        metavar="TOKEN",
        help="CORRECT [WRONG] for every prompt: one-token strings, or id:N",
    )
    p.add_argument(
        "--answers-file", default=None, metavar="FILE", help="one line per prompt: CORRECT<TAB>WRONG"
    )
    p.add_argument(
        "--metric",
        choices=("logit-diff", "prob", "kl"),
        default="logit-diff",
        help="logit-diff (correct minus wrong at the last token), prob (of correct), kl (from the "
        "clean run); default logit-diff",
    )
    p.add_argument("--method", choices=("eap", "eap-ig", "patching"), default="eap-ig", help="default eap-ig")
    p.add_argument("--steps", type=int, default=5, help="EAP-IG's interpolation steps (default 5)")
    p.add_argument("--batch-size", type=int, default=None, help="prompts per chunk (default: by memory)")
    p.add_argument("--top", type=int, default=20, help="how many edges to print (default 20)")
    p.add_argument(
        "--curve", type=counts, default=None, metavar="N,N,...", help="edge counts for the faithfulness curve"
    )
    p.add_argument("--how", choices=("greedy", "top"), default="greedy", help="how --curve chooses edges")
    p.add_argument(
        "--json", default=None, metavar="FILE", help="write the graph and every edge's score as JSON"
    )
    p.add_argument("--csv", default=None, metavar="FILE", help="write the table of edges as CSV")
    p.add_argument(
        "--report",
        default=None,
        metavar="DIR",
        help="write the HTML report of the clean prompts with the circuit: its graph, its faithfulness "
        "curve (--curve's counts, else 1, 2, 5, 10, ... edges) and its edges (DIR/index.html)",
    )
    p.set_defaults(func=cmd_circuit)
