"""The ``probe`` command line: ``probe capture``, ``probe info``, ``probe report``, ``probe models``.

Problems the user can fix are printed as one line (``probe: error: ...``) with exit code 2 and
no traceback; nothing half-written is left behind.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from probe.errors import ProbeError


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _ints(text: str) -> list[int]:
    try:
        return [int(p) for p in text.replace(" ", "").split(",") if p != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 0,2,5, got {text!r}"
        ) from None


def _load_zoo(name: str):
    import models

    if name not in models.names():
        raise ProbeError(
            f"unknown model {name!r}; choose one of: {', '.join(models.names())} (see `probe models`)"
        )
    return models.load(name)


def add_model_args(p: argparse.ArgumentParser, *, default: str | None = "minigpt") -> None:
    """``--model NAME`` (zoo) and ``--hf PATH`` (a local Hugging Face model folder), one of them."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--model", "-m", default=None, help=f"zoo model name (see `probe models`; default: {default})"
    )
    g.add_argument("--hf", metavar="PATH", default=None, help="a local Hugging Face model folder (offline)")
    p.set_defaults(default_model=default)


def load_model(args: argparse.Namespace):
    """The model named by ``--model`` / ``--hf``; returns ``(model, tokenizer)`` in eval mode."""
    if getattr(args, "hf", None):
        return _load_hf(args.hf)
    name = args.model or args.default_model
    if name is None:
        raise ProbeError("no model given; pass --model NAME (see `probe models`) or --hf PATH")
    model = _load_zoo(name)
    return model, model.tokenizer


def _load_hf(path: str):
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = Path(path)
    if not folder.is_dir() or not (folder / "config.json").is_file():
        raise ProbeError(
            f"--hf {path}: not a Hugging Face model folder (no config.json); give a local folder"
        )
    try:
        import transformers
    except ImportError:
        raise ProbeError("--hf needs transformers; install it with `pip install -e '.[hf]'`") from None
    config = transformers.AutoConfig.from_pretrained(folder)
    auto = transformers.AutoModel
    if getattr(config, "is_encoder_decoder", False):
        auto = transformers.AutoModelForSeq2SeqLM
    elif any(a.endswith("ForCausalLM") for a in (config.architectures or [])):
        auto = transformers.AutoModelForCausalLM
    try:
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        model = auto.from_pretrained(folder).eval()
    except (OSError, ValueError) as e:
        raise ProbeError(f"--hf {path}: could not load ({str(e).splitlines()[0]})") from None
    return model, tok


def cmd_capture(args: argparse.Namespace) -> int:
    import probe
    from probe.cache.writer import check_output

    out = Path(args.output)
    if out.suffix != ".safetensors":
        raise ProbeError(f"output {out} should end in .safetensors")
    check_output(out)  # before loading the model and running the forward
    model, tok = load_model(args)
    text = args.text if len(args.text) > 1 else args.text[0]
    target = None
    if args.target is not None:
        target = args.target if len(args.target) > 1 else args.target[0]
    cache = probe.capture(
        model,
        text,
        tokenizer=tok,
        target=target,
        out=out,
        layers=args.layers,
        heads=args.heads,
        dtype=args.dtype,
    )
    n = len(cache.keys())
    print(f"wrote {out} ({_human(out.stat().st_size)}, {n} tensors); inspect it with `probe info {out}`")
    return 0


def info_text(path: str | Path) -> str:
    """A readable summary of the cache at ``path``: model, tokens, keys, shapes and sizes."""
    import probe

    cache = probe.load(path)
    meta = cache.metadata
    p = Path(path)
    lines = [f"{p}  ({_human(p.stat().st_size)})"]
    model = meta.get("model", {})
    lines.append(
        f"model:     {model.get('name', '?')}  ({model.get('class', '?')}, "
        f"{model.get('parameters', 0):,} parameters)"
    )
    lines.append(
        f"attention: {', '.join(meta.get('attention_implementations', [])) or '?'}"
        f"   stored as {meta.get('dtype', '?')}"
    )
    lines.append(
        f"format:    probe cache v{meta.get('format_version', '?')}, written by probe "
        f"{meta.get('probe_version', '?')}"
    )
    stacks = meta.get("stacks", {})
    for s in cache.stacks:
        heads = {e.get("self_attn", {}).get("heads") for e in meta.get("layers", []) if e.get("stack") == s}
        heads.discard(None)
        hs = ", ".join(str(h) for h in sorted(heads)) or "?"
        lines.append(
            f"{s}:   {cache.n_layers(s)} of {stacks.get(s, {}).get('layers', '?')} "
            f"layers captured, {hs} heads"
        )
    if meta.get("training"):
        lines.append("mode:      train (patterns are the weights before dropout)")
    no_deltas: dict[tuple[str, str], list[str]] = {}  # layers stored without deltas, by reason
    for e in meta.get("layers", []):
        if e.get("residual_note"):
            no_deltas.setdefault((e.get("stack"), e["residual_note"]), []).append(str(e.get("layer")))
    for (stack, note), idx in no_deltas.items():
        lines.append(f"no deltas: {stack}.blocks.{','.join(idx)}: {note}")
    texts = meta.get("texts") or []
    for i, toks in enumerate(cache.tokens):
        label = f"text {i}:" if texts else f"input {i}:"
        shown = " | ".join(toks[:24]) + (" | ..." if len(toks) > 24 else "")
        lines.append(f"{label:9} {len(toks)} tokens: {shown}")
        if cache.target_tokens:
            tt = cache.target_tokens[i]
            lines.append(f"{'target:':9} {len(tt)} tokens: {' | '.join(tt[:24])}")
    lines.append("")
    width = max((len(k) for k in cache.keys()), default=10)
    lines.append(f"{'key':{width}}  {'shape':22} {'size':>10}")
    total = 0
    for k in cache.keys():
        nb = cache.nbytes(k)
        total += nb
        shape = "[" + ", ".join(str(d) for d in cache.shape(k)) + "]"
        lines.append(f"{k:{width}}  {shape:22} {_human(nb):>10}")
    lines.append(f"{len(cache.keys())} tensors, {_human(total)}")
    return "\n".join(lines)


def cmd_info(args: argparse.Namespace) -> int:
    p = Path(args.path)
    if p.is_dir() and ((p / "manifest.json").is_file() or (p / "config.json").is_file()):  # a corpus run
        from probe.corpus import open_corpus

        print(open_corpus(args.path).summary())
        return 0
    print(info_text(args.path))
    return 0


def cmd_corpus(args: argparse.Namespace) -> int:
    from probe.corpus import run_corpus

    keep: object = args.keep
    if args.layers is not None or args.heads is not None:
        if args.keep not in (None, "patterns"):
            raise ProbeError(
                "--layers/--heads choose which patterns to keep; drop --keep or use --keep patterns"
            )
        keep = {"layers": args.layers, "heads": args.heads}
    elif keep == "patterns":  # every pattern, no residuals ("all" stores both)
        keep = {"layers": None, "heads": None}
    elif keep is None:
        keep = "stats"
    if not Path(args.texts).is_file():
        raise ProbeError(
            f"--texts {args.texts}: no such file; give a .txt (one text per line) or .jsonl file"
        )
    model, tok = load_model(args)
    corpus = run_corpus(
        model,
        args.texts,
        args.output,
        tokenizer=tok,
        batch_size=args.batch_size,
        keep=keep,
        shard_size=args.shard_size,
        field=args.field,
        dtype=args.dtype,
        progress=not args.quiet,
    )
    from probe.corpus.dist import rank_world

    if rank_world()[0] == 0:
        print(corpus.summary())
    return 0


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
        print(table.to_text(max_rows=args.rows))
        if args.csv:
            print(f"wrote {args.csv}")
    return 0


def _text_caches(args: argparse.Namespace):
    """Captures of the texts in ``--texts`` (one per line), ``--batch`` at a time, lazily."""
    from probe import forward

    path = Path(args.texts)
    if not path.is_file():
        raise ProbeError(f"--texts {args.texts}: no such file; give a text file with one text per line")
    texts = [t for t in path.read_text(encoding="utf-8").splitlines() if t.strip()]
    if not texts:
        raise ProbeError(f"--texts {args.texts}: the file has no texts (one per line)")
    model, tok = load_model(args)

    class _Batches:
        def __len__(self) -> int:
            return (len(texts) + args.batch - 1) // args.batch

        def __iter__(self):
            for i in range(0, len(texts), args.batch):
                yield forward.capture(model, texts[i : i + args.batch], tokenizer=tok)

    return _Batches()


def cmd_models(args: argparse.Namespace) -> int:
    import models

    for name in models.names():
        doc = (models.module(name).__doc__ or "").strip().splitlines()
        print(f"{name:15} {doc[0] if doc else ''}")
    return 0


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
        model, tok = load_model(args)
        text = None if not inputs else (inputs if len(inputs) > 1 else inputs[0])
        report = probe.check_causal(model, text, tokenizer=tok, expect=expect)
    if args.json:
        print(report.to_json())
    else:
        print(report)
    return 0 if report.ok else 1


# -- residual stream and anatomy (issue 12) ---------------------------------------------------------
def _export(result, args: argparse.Namespace) -> None:
    """Write ``--csv``/``--json`` exports of a result (atomically) and say where."""
    for fmt in ("csv", "json"):
        path = getattr(args, fmt, None)
        if path:
            getattr(result, f"to_{fmt}")(path)
            print(f"wrote {path}")


def _export_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--csv", default=None, help=f"also write {what} to this CSV file")
    p.add_argument("--json", default=None, help=f"also write {what} to this JSON file")


def cmd_residual(args: argparse.Namespace) -> int:
    import probe

    stats = probe.residual(probe.load(args.path))
    print(stats.layers.to_text(max_rows=10_000))
    for n in stats.notes:
        print(f"note: {n}")
    _export(stats.tokens if args.tokens else stats.layers, args)
    return 0


def cmd_lens(args: argparse.Namespace) -> int:
    import probe

    model, tok = load_model(args)
    text = args.text if len(args.text) > 1 else args.text[0]
    lens = probe.logit_lens(model, text, tokenizer=tok, target=args.target, k=args.k)
    print(f"read-out: {lens.readout}; last layer vs the model's logits: max |diff| {lens.final_error:.2e}")
    print("top-1 token and p(final prediction) per layer (rows) and position (columns):")
    print(lens.to_text(0))
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
    _export(lens, args)
    return 0


def cmd_budget(args: argparse.Namespace) -> int:
    import probe

    if args.config and (args.model or args.hf):
        raise ProbeError("give one of --model, --hf or --config, not several")
    if args.config:
        b = probe.budget(args.config)
    else:
        model, _ = load_model(args)
        b = probe.budget(model)
    print(b.to_text())
    if args.layers:
        print(b.by_layer.to_text(max_rows=10_000))
    _export(b, args)
    return 0


def _add_residual_commands(sub) -> None:
    p = sub.add_parser(
        "residual",
        help="residual-stream statistics of a cache (|E|, |ΔE|, ratio, cosine per sublayer)",
        description="Per layer and sublayer: the mean |E| and |ΔE| (L2), |ΔE|/|E|, cos(ΔE, E) and how "
        "often the sublayer writes most, from a cache written by `probe capture`.",
        epilog="example: probe residual run.safetensors --csv residual.csv",
    )
    p.add_argument("path", help="a .safetensors cache written by probe")
    p.add_argument("--tokens", action="store_true", help="export one row per token instead of per layer")
    _export_args(p, "the table")
    p.set_defaults(func=cmd_residual)

    p = sub.add_parser(
        "lens",
        help="logit lens and direct logit attribution of a model on a text",
        description="Read every layer's residual stream through the model's own final norm and "
        "unembedding (the logit lens), and split the predicted token's logit among the embedding, "
        "each sublayer and each head (direct logit attribution, final norm's scale frozen).",
        epilog='example: probe lens --model minigpt "attention lets tokens read"',
    )
    p.add_argument("text", nargs="+", metavar="TEXT", help="input text (the first is shown)")
    add_model_args(p)
    p.add_argument("--target", "-t", nargs="+", default=None, help="decoder text for encoder-decoders")
    p.add_argument("-k", type=int, default=5, help="top-k tokens per cell in the exports (default 5)")
    p.add_argument("--position", type=int, default=-1, help="position to attribute (default: the last)")
    _export_args(p, "the lens table")
    p.set_defaults(func=cmd_lens)

    p = sub.add_parser(
        "budget",
        help="where a model's parameters live (embedding, W_Q/K/V/O, MLP, norms, ...)",
        description="Count a model's parameters by role and layer from its module tree; tied weights "
        "counted once. --config builds a Hugging Face config on the meta device (no memory); "
        "--config gpt3 is the tutorial's GPT-3 (175B).",
        epilog="examples: probe budget --model translator;  probe budget --config gpt3",
    )
    add_model_args(p, default="minigpt")
    p.add_argument("--config", default=None, metavar="FILE", help="a config.json, or the preset gpt3")
    p.add_argument("--layers", action="store_true", help="also print the per-layer table")
    _export_args(p, "the by-role table")
    p.set_defaults(func=cmd_budget)


def _layer_arg(text: str):
    if text == "mean":
        return "mean"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a layer/head index or 'mean', got {text!r}") from None


def align_text(al) -> str:
    """A readable summary of a :class:`probe.Alignment`: selection, links per pair, scores."""
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
    return "\n".join(lines)


def cmd_align(args: argparse.Namespace) -> int:
    import probe

    p = Path(args.path)
    if not p.is_file():
        raise ProbeError(f"{p} does not exist; give a cache written by `probe capture`")
    cache = probe.load(p)
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
        print(align_text(al))
    return 0


def _report_name(text: str) -> str:
    import re

    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "report"


def cmd_report(args: argparse.Namespace) -> int:
    import probe

    inputs = list(args.inputs)
    model_given = bool(args.model or args.hf)
    if not inputs:
        raise ProbeError("nothing to report; give a cache file (run.safetensors) or --model NAME and a text")
    if not model_given and all(i.endswith(".safetensors") for i in inputs):
        caches = [probe.load(i) for i in inputs]
        name = Path(inputs[0]).stem
        model = tok = None
    else:
        if any(i.endswith(".safetensors") for i in inputs):
            raise ProbeError(
                "give either cache files (probe report run.safetensors) or texts with a model "
                "(probe report --model minigpt 'text'), not both"
            )
        model, tok = load_model(args)
        text = inputs if len(inputs) > 1 else inputs[0]
        target = None
        if args.target is not None:
            target = args.target if len(args.target) > 1 else args.target[0]
        caches = [probe.capture(model, text, tokenizer=tok, target=target)]
        name = Path(args.hf).name if args.hf else (args.model or args.default_model)
    out = Path(args.output) if args.output else Path("reports") / _report_name(name)
    path = probe.report(caches, out, model=model, tokenizer=tok)
    print(f"wrote {path} ({_human(path.stat().st_size)}); open it in a browser: {path.resolve().as_uri()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``probe`` command."""
    parser = argparse.ArgumentParser(
        prog="probe",
        description="See what attention inside a transformer really does: capture every "
        "attention pattern and residual delta into a safetensors cache.",
    )
    from probe import __version__

    parser.add_argument("--version", action="version", version=f"probe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "capture",
        help="run a model on text and write its attention cache",
        description="Run a model from the bundled zoo (or a local Hugging Face folder) on TEXT and "
        "stream every attention pattern and residual-stream delta into a safetensors cache.",
        epilog="example: probe capture --model minigpt 'attention lets tokens read.' -o run.safetensors",
    )
    p.add_argument("text", nargs="+", metavar="TEXT", help="input text (several = one batch)")
    add_model_args(p)
    p.add_argument(
        "--target",
        "-t",
        nargs="+",
        default=None,
        help="decoder text for encoder-decoders (teacher forcing); default: greedy decoding",
    )
    p.add_argument("-o", "--output", required=True, help="cache file to write (.safetensors)")
    p.add_argument("--layers", type=_ints, default=None, help="layer indices to keep, e.g. 0,3")
    p.add_argument("--heads", type=_ints, default=None, help="head indices to keep, e.g. 0,1")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "float16", "bfloat16"],
        help="store tensors in this dtype (default: as computed)",
    )
    p.set_defaults(func=cmd_capture)

    p = sub.add_parser(
        "info",
        help="summarise a cache file",
        description="Print a readable summary of a probe cache: model, tokens, keys, shapes and sizes.",
    )
    p.add_argument("path", help="a .safetensors cache written by probe, or a corpus run folder")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser(
        "corpus",
        help="capture a corpus: bounded memory, resumable, torchrun-aware",
        description="Run a model over many texts: shards of cache files (or statistics only), a "
        "manifest mapping every text to its shard and row (or its error), and merged per-head "
        "statistics (head_stats.json/.csv). Rerun the same command to resume; launch it with "
        "`torchrun --nproc_per_node=N -m probe corpus ...` to share the shards between processes.",
        epilog="examples: probe corpus --model minigpt --texts texts.txt -o run/ | "
        "probe corpus --hf ./gpt2 --texts data.jsonl --field text -o run/ --layers 0 5 --heads 1 2",
    )
    add_model_args(p, default=None)
    p.add_argument("--texts", metavar="FILE", required=True, help="one text per line, or JSONL with --field")
    p.add_argument("--field", default=None, help="JSONL field holding the text (default: text)")
    p.add_argument("-o", "--output", required=True, help="output folder (resumed when it holds this run)")
    p.add_argument("--batch-size", type=int, default=8, help="texts per forward pass (default 8)")
    p.add_argument("--shard-size", type=int, default=256, help="texts per shard (default 256)")
    p.add_argument(
        "--keep",
        choices=["stats", "all", "residuals", "patterns"],
        default=None,
        help="what to store: stats (default: statistics only), all (patterns and residuals), "
        "residuals, or patterns (every pattern, or those chosen by --layers/--heads)",
    )
    p.add_argument("--layers", type=int, nargs="+", default=None, help="keep patterns of these layers")
    p.add_argument("--heads", type=int, nargs="+", default=None, help="keep patterns of these heads")
    p.add_argument(
        "--dtype",
        choices=["float16", "bfloat16"],
        default=None,
        help="store kept tensors in this precision (half the disk; statistics still read float32)",
    )
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_corpus)

    p = sub.add_parser(
        "check",
        help="audit a model's causal and padding masks (exit 0 causal, 1 leak, 2 bad input)",
        description="Prove a model never attends to the future or to padding, or show where it does: "
        "static checks on the captured patterns, then (with a model) suffix perturbation, input "
        "gradients, padding parity, KV-cache decoding and eager-vs-SDPA parity.",
        epilog="examples: probe check --model minigpt 'attention lets tokens read.'   "
        "probe check run.safetensors --expect causal   probe check --hf ./my-model 'some text'",
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

    p = sub.add_parser(
        "report",
        help="write an offline HTML report (capture first when given a model and text)",
        description="Write one self-contained index.html (no network needed to view it): model and "
        "tokens, every head's attention (overview and explorer), cross-attention, the residual "
        "stream and the analyses. Give cache files, or a model and text to capture first.",
        epilog="examples: probe report --model minigpt 'attention lets tokens read.'   "
        "probe report run.safetensors -o reports/run   probe report --hf ./my-bert 'some text'",
    )
    p.add_argument(
        "inputs",
        nargs="*",
        metavar="CACHE_OR_TEXT",
        help="cache files (.safetensors), or texts to capture with --model/--hf (default model: minigpt)",
    )
    add_model_args(p)
    p.add_argument(
        "--target", "-t", nargs="+", default=None, help="decoder text for encoder-decoders (teacher forcing)"
    )
    p.add_argument("-o", "--output", default=None, help="report folder (default: reports/<model or cache>/)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser(
        "stats",
        help="per-head focus statistics and roles",
        description="Per-head focus statistics (entropy, confidence, offsets, sink, distance, span, "
        "templates, roles; definitions in probe.analysis.focus) of a cache, or mean ± std over texts "
        "captured from a model.",
        epilog="examples: probe stats run.safetensors --sort entropy --csv heads.csv | "
        "probe stats --model minigpt --texts texts.txt",
    )
    p.add_argument("path", nargs="?", default=None, help="a .safetensors cache written by probe")
    add_model_args(p, default=None)
    p.add_argument("--texts", metavar="FILE", default=None, help="texts to capture, one per line")
    p.add_argument("--batch", type=int, default=8, help="texts per forward pass with --texts (default 8)")
    p.add_argument("--sort", default="entropy", help="metric to sort by (default: entropy)")
    p.add_argument("--ascending", action="store_true", help="smallest first")
    p.add_argument("--rows", type=int, default=40, help="rows to print (default 40)")
    p.add_argument("--csv", metavar="OUT", default=None, help="also write the table as CSV")
    p.add_argument("--json", action="store_true", help="print JSON instead of the text table")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser(
        "models",
        help="list the bundled model zoo",
        description="List the textbook models bundled with probe.",
    )
    p.set_defaults(func=cmd_models)
    _add_residual_commands(sub)

    p = sub.add_parser(
        "align",
        help="word alignments from an encoder-decoder's cross-attention (AER with gold links)",
        description="Read word alignments from the decoder cross-attention of a cache: subword "
        "pieces merged to words, special tokens left out. With --gold, score every layer and head "
        "(AER, precision, recall) and pick the best; without, report the alignment's shape "
        "(diagonality, monotonicity, coverage, entropy, jumps).",
        epilog="example: probe capture -m aligner 'gestern sah der mann den hund' -o run.safetensors "
        "&& probe align run.safetensors --pharaoh",
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
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like Ctrl-C so every ``finally`` and abort runs (no temp file left)."""


def _on_signal(signum: int, frame: object) -> None:
    raise Terminated(signum)


def _catch_signals() -> dict:
    import signal

    old = {}
    for name in ("SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) in (signal.SIG_DFL, None):
            try:
                old[sig] = signal.signal(sig, _on_signal)
            except ValueError:  # not the main thread: leave signals alone
                pass
    return old


def _quiet_stdout() -> None:
    # the reader of our output went away (`probe info x | head -1`): stop quietly; point stdout at
    # /dev/null so the interpreter's final flush does not fail again
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``probe`` console script; returns the exit code.

    The one error boundary: a :class:`ProbeError` or ``OSError`` becomes one line on stderr and
    exit code 2; a closed output pipe exits quietly (0); Ctrl-C exits 130 and SIGTERM/SIGHUP
    128 + the signal number, each after the temporary files are removed.
    """
    import signal

    from probe.errors import describe_os_error

    parser = build_parser()
    args = parser.parse_args(argv)
    old = _catch_signals()
    try:
        code = args.func(args)
        sys.stdout.flush()
        return code
    except ProbeError as e:
        print(f"probe: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        _quiet_stdout()
        return 0
    except OSError as e:
        print(f"probe: error: {describe_os_error(e, 'cannot use')}", file=sys.stderr)
        return 2
    except Terminated as e:
        signum = e.args[0] if e.args else signal.SIGTERM
        print(f"probe: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    except KeyboardInterrupt:
        print("probe: interrupted", file=sys.stderr)
        return 130
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
