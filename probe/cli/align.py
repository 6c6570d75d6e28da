"""``probe align``: word alignments from an encoder-decoder's cross-attention."""

from __future__ import annotations

import argparse
import sys

from probe.cli.common import examples


def _layer_arg(text: str):
    if text == "mean":
        return "mean"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a layer/head index or 'mean', got {text!r}") from None


def align_text(al, heuristic: bool = False) -> str:
    """A readable summary of a :class:`probe.Alignment`: selection, links per pair, scores;
    ``heuristic``: the selection is the gold-free default, so say so and list the most diagonal
    single heads to compare it with."""
    sel = al.selection()
    as_ = "shifted decoder input" if sel["convention"] == "input" else "decoder output"
    lines = [
        f"alignment: decoder layer {sel['layer']}, head {sel['head']}, {sel['convention']} convention "
        f"(target token as {as_}), "
        f"{sel['method']}; {len(al.links)} pair(s), decoder layers {al.layers}, {al.n_heads} heads"
    ]
    for b, (s, t, A) in enumerate(zip(al.source, al.target, al.links, strict=True)):
        if b == 5:
            lines.append(f"... {len(al.links) - 5} more pairs (--pharaoh prints them all)")
            break
        lines.append(f"pair {b}: {' '.join(s.words)}  ->  {' '.join(t.words)}")
        lines.append(
            "  " + "  ".join(f"{t.words[j]}<-{s.words[i]}" for i, j in sorted(A, key=lambda x: x[1]))
        )
    if al.scores is not None:
        lines.append("")
        lines.append("lowest AER (precision, recall) over conventions, layers and heads:")
        lines.append(al.scores.top("aer", 10, descending=False).to_text())
        b = al.best
        lines.append(
            f"best: {b['convention']} convention, layer {b['layer']}, head {b['head']}: AER {b['aer']:.3f}, "
            f"precision {b['precision']:.3f}, recall {b['recall']:.3f}"
        )
    st = [
        r
        for r in al.stats
        if r["convention"] == al.convention and r["layer"] == al.layer and r["head"] == al.head
    ][0]
    lines.append(
        "shape: "
        + ", ".join(
            f"{k} {st[k]:.3f}"
            for k in ("diagonality", "monotonicity", "coverage", "low_mass", "entropy", "jumps")
        )
    )
    lines += [f"note: {n}" for n in al.notes]
    if heuristic and al.gold is None:
        from probe.analysis.alignment import candidates
        from probe.analysis.alignment.diagonal import HEURISTIC

        lines.append(f"note: {HEURISTIC}; compare the most diagonal single heads (pair 0):")
        for c in candidates(al):
            lines.append(
                f"  {c['convention']:6} layer {c['layer']} head {c['head']}: diagonality "
                f"{c['diagonality']:.3f}, monotonicity {c['monotonicity']:.3f}: {c['text']}"
            )
        lines.append("  (choose one with --layer L --head H --convention C, or score them with --gold FILE)")
    return "\n".join(lines)


def cmd_align(args: argparse.Namespace) -> int:
    import probe

    cache = probe.load(args.path)  # says what is wrong: missing, a folder, not a cache
    reverse = probe.load(args.reverse) if args.reverse else None
    al = probe.align(
        cache,
        gold=args.gold,
        layer=args.layer,
        head=args.head,
        method=args.method,
        convention=args.convention,
        threshold=args.threshold,
        reverse=reverse,
        one_indexed=args.one_indexed,
    )
    if args.json:
        import json

        from probe.files import write_text_atomic

        write_text_atomic(args.json, json.dumps(al.to_dict(), ensure_ascii=False, default=str))
    if args.pharaoh:
        sys.stdout.write(al.pharaoh(one_indexed=args.one_indexed))
    else:
        print(align_text(al, heuristic=args.layer is None and args.head is None))
    return 0


def add_parser(sub) -> None:
    """``probe align``."""
    p = sub.add_parser(
        "align",
        help="word alignments from an encoder-decoder's cross-attention (AER with gold links)",
        description="Read word alignments from the decoder cross-attention of a cache: subword "
        "pieces merged to words, special tokens left out. With --gold, score every layer and head "
        "(AER, precision, recall) and pick the best; without, report the alignment's shape "
        "(diagonality, monotonicity, coverage, entropy, jumps).",
        epilog=examples(
            "probe capture -m aligner 'gestern sah der mann den hund' -o run.safetensors",
            "probe align run.safetensors --pharaoh",
            "probe align run.safetensors --gold gold.talp --one-indexed",
        ),
    )
    p.add_argument("path", help="a .safetensors cache of an encoder-decoder, written by probe")
    p.add_argument(
        "--gold", metavar="FILE", help="gold links, Pharaoh/talp: i-j sure, ipj possible, one line per pair"
    )
    p.add_argument(
        "--one-indexed", action="store_true", help="gold (and --pharaoh output) count words from 1"
    )
    p.add_argument(
        "--layer",
        type=_layer_arg,
        default=None,
        help="decoder layer (or 'mean'); default: best by AER with --gold, else the penultimate",
    )
    p.add_argument("--head", type=_layer_arg, default=None, help="head (or 'mean', the default)")
    p.add_argument(
        "--convention",
        choices=["input", "output"],
        default=None,
        help="target token as shifted decoder input or as decoder output (default: the better one "
        "with --gold, else input)",
    )
    p.add_argument(
        "--method", default="argmax", choices=["argmax", "threshold", "intersect", "union", "grow-diag-final"]
    )
    p.add_argument(
        "--threshold", type=float, default=0.1, help="attention mass for --method threshold (default 0.1)"
    )
    p.add_argument(
        "--reverse",
        metavar="CACHE",
        help="a cache of the other direction, for intersect/union/grow-diag-final",
    )
    p.add_argument(
        "--pharaoh", action="store_true", help="print only the links, i-j per pair, one line per pair"
    )
    p.add_argument("--json", metavar="FILE", help="also write the full result as JSON")
    p.set_defaults(func=cmd_align)
