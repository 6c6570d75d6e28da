"""``probe capture``, ``probe info`` and ``probe models``: write a cache, summarise one, list the zoo."""

from __future__ import annotations

import argparse
from pathlib import Path

from probe.cli import audio, common
from probe.cli.common import add_image_args, add_model_args, examples, int_list
from probe.errors import ProbeError
from probe.files import human_size


def cmd_capture(args: argparse.Namespace) -> int:
    import probe
    from probe.cache.writer import check_output
    from probe.capture.consumers.kept import parse_keep_arg

    keep = parse_keep_arg(args.keep)  # before loading the model
    out = Path(args.output)
    if out.suffix != ".safetensors":
        raise ProbeError(f"output {out} should end in .safetensors")
    check_output(out)  # before loading the model and running the forward
    if args.audio:  # sound files through the model's feature extractor (probe/cli/audio.py)
        audio.check_audio_args(args, args.text)
        model, tok, processor = audio.load_audio_model(args)
        kw = {"layers": args.layers, "heads": args.heads, "dtype": args.dtype, "keep": keep}
        cache = audio.capture_audio(args, model, tok, processor, out=out, **kw)
        n = len(cache.keys())
        print(
            f"wrote {out} ({human_size(out.stat().st_size)}, {n} tensors); inspect it with `probe info {out}`"
        )
        return 0
    if not args.text and not args.image:
        raise ProbeError(
            "nothing to capture; give a TEXT or --image PATH (and a TEXT for a vision-language model)"
        )
    prompt = None
    if args.image:  # a --hf folder's processor refused before its model loads; a zoo model's own
        model, tok, processor = common.load_image_model(args, text=bool(args.text))
        if args.text:  # pictures with a text: a vision-language model
            prompt = args.text if len(args.text) > 1 else args.text[0]
    else:
        processor = None
        model, tok = common.load_model(args)
    if args.image:
        text = args.image
    else:
        text = args.text if len(args.text) > 1 else args.text[0]
    target = None
    if args.target is not None:
        target = args.target if len(args.target) > 1 else args.target[0]
    cache = probe.capture(
        model,
        text,
        tokenizer=tok,
        target=target,
        processor=processor,
        text=prompt,
        out=out,
        layers=args.layers,
        heads=args.heads,
        dtype=args.dtype,
        keep=keep,
    )
    n = len(cache.keys())
    print(f"wrote {out} ({human_size(out.stat().st_size)}, {n} tensors); inspect it with `probe info {out}`")
    return 0


def info_text(path: str | Path) -> str:
    """A readable summary of the cache at ``path``: model, tokens, keys, shapes and sizes."""
    import probe
    from probe.report.labels import display  # tokens shown as everywhere in probe (␣ for a space)

    cache = probe.load(path)
    meta = cache.metadata
    p = Path(path)
    lines = [f"{p}  ({human_size(p.stat().st_size)})"]
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
    if cache.partial:
        from probe.cache.kept import describe

        lines.append(f"kept:      {describe(cache.kept)} (no whole patterns)")
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
        shown = " | ".join(display(t, None) for t in toks[:24]) + (" | ..." if len(toks) > 24 else "")
        lines.append(f"{label:9} {len(toks)} tokens: {shown}")
        if cache.target_tokens:
            tt = cache.target_tokens[i]
            lines.append(f"{'target:':9} {len(tt)} tokens: {' | '.join(display(t, None) for t in tt[:24])}")
    lines.append("")
    width = max((len(k) for k in cache.keys()), default=10)
    lines.append(f"{'key':{width}}  {'shape':22} {'size':>10}")
    total = 0
    for k in cache.keys():
        nb = cache.nbytes(k)
        total += nb
        shape = "[" + ", ".join(str(d) for d in cache.shape(k)) + "]"
        lines.append(f"{k:{width}}  {shape:22} {human_size(nb):>10}")
    lines.append(f"{len(cache.keys())} tensors, {human_size(total)}")
    return "\n".join(lines)


def cmd_info(args: argparse.Namespace) -> int:
    p = Path(args.path)
    if p.is_dir() and ((p / "manifest.json").is_file() or (p / "config.json").is_file()):  # a corpus run
        from probe.corpus import open_corpus

        print(open_corpus(args.path).summary())
        return 0
    print(info_text(args.path))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    import models

    for name in models.names():
        doc = (models.module(name).__doc__ or "").strip().splitlines()
        print(f"{name:15} {doc[0] if doc else ''}")
    return 0


def add_capture_parser(sub) -> None:
    """``probe capture``."""
    p = sub.add_parser(
        "capture",
        help="run a model on text and write its attention cache",
        description="Run a model from the bundled zoo (or a local Hugging Face folder) on TEXT and "
        "stream every attention pattern and residual-stream delta into a safetensors cache.",
        epilog=examples(
            "probe capture --model minigpt 'attention lets tokens read.' -o run.safetensors",
            "probe capture --model translator 'ich mochte ein bier' --target 'S i want a beer'",
            "probe capture --hf ./my-model 'some text' --layers 0,1 -o run.safetensors",
            "probe capture --hf ./my-vit --image cat.png --image dog.png -o vit.safetensors",
            "probe capture --hf ./my-whisper --audio talk.wav --target 'the words said' -o talk.safetensors",
            "probe capture --hf ./my-llava --image cat.png 'USER: <image> what is it?' -o llava.safetensors",
            "probe capture --model minigpt 'a long text' --keep rows:-1,-2 -o rows.safetensors",
            "probe capture --model minigpt 'a long text' --keep topk:32 -o topk.safetensors",
            "probe capture --model minigpt 'a long text' --keep stats -o stats.safetensors",
        ),
    )
    p.add_argument("text", nargs="*", metavar="TEXT", help="input text (several = one batch)")
    add_model_args(p)
    add_image_args(p)
    audio.add_audio_args(p)
    p.add_argument(
        "--target",
        "-t",
        nargs="+",
        default=None,
        help="decoder text for encoder-decoders (teacher forcing); default: greedy decoding",
    )
    p.add_argument("-o", "--output", required=True, help="cache file to write (.safetensors)")
    p.add_argument("--layers", type=int_list, default=None, help="layer indices to keep, e.g. 0,3")
    p.add_argument("--heads", type=int_list, default=None, help="head indices to keep, e.g. 0,1")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "float16", "bfloat16"],
        help="store tensors in this dtype (default: as computed)",
    )
    p.add_argument(
        "--keep",
        default="patterns",
        metavar="WHAT",
        help="what to keep of each attention: 'patterns' (default: whole [query, key] patterns), "
        "'stats' (each head's statistics computed while the model runs, residual norms instead of "
        "residual tensors), "
        "'rows:-1,-2' (those query rows of every text over every key; rows count the real tokens, "
        "-1 is the last) or 'topk:32' (the 32 largest weights of every row, their key positions "
        "and the mass they keep); rows and topk never hold a whole pattern, for long texts",
    )
    p.set_defaults(func=cmd_capture)


def add_info_parser(sub) -> None:
    """``probe info``."""
    p = sub.add_parser(
        "info",
        help="summarise a cache file",
        description="Print a readable summary of a probe cache: model, tokens, keys, shapes and sizes.",
        epilog=examples("probe info run.safetensors", "probe info run/  (a corpus run folder)"),
    )
    p.add_argument("path", help="a .safetensors cache written by probe, or a corpus run folder")
    p.set_defaults(func=cmd_info)


def add_models_parser(sub) -> None:
    """``probe models``."""
    p = sub.add_parser(
        "models",
        help="list the bundled model zoo",
        description="List the textbook models bundled with probe.",
        epilog=examples("probe models", "probe report --model minigpt 'attention lets tokens read.'"),
    )
    p.set_defaults(func=cmd_models)
