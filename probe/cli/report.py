"""``probe report``: the offline HTML report, from caches or from a model and text."""

from __future__ import annotations

import argparse
from pathlib import Path

from probe.cli import audio, common
from probe.cli.common import add_image_args, add_model_args, examples
from probe.cli.intervene import add_metric_args, metric_kwargs
from probe.errors import ProbeError
from probe.files import human_size


def report_name(text: str) -> str:
    """``text`` as a folder name under reports/: runs of other characters as ``_``."""
    import re

    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "report"


def _media_dir(args: argparse.Namespace, media: list[str]) -> Path:
    """``-o``, else ``reports/<model>-<first picture or sound's name>/``: a report of the same file
    by another model goes to its own folder (reports/vit_zoo-cat/, reports/my-vit-cat/)."""
    if args.output:
        return Path(args.output)
    return Path("reports") / report_name(f"{common.model_label(args)}-{Path(media[0]).stem}")


def _tutorial_cache(cache, model):
    """For a zoo model that re-creates a tutorial, a capture of the tutorial's own text for the
    report's tutorial figures (None when the cache is that text already, or for other models).
    ``model`` is the zoo model already loaded; from cache files, the zoo model is loaded only when
    its checkpoint is on disk (a report never trains the translator)."""
    from probe.report import seeds

    name = (cache.metadata.get("model") or {}).get("name")
    if name not in seeds.MODELS or seeds.is_tutorial_cache(cache, name):
        return None
    if model is None or getattr(model, "name", None) != name:
        import models

        if not models.checkpoint_path(name).exists():
            return None
        model = models.load(name)
    import probe

    text, target = seeds.TEXTS[name]
    return probe.capture(model, text, target=target)


MEASURE = "measure"  # --importance with no file: measure it on the report's texts


def _saved_results(args: argparse.Namespace, from_caches: bool):
    """``--importance FILE`` and ``--patching FILE...`` read (and refused, exit 2) before any model
    runs; ``--importance`` alone needs a model to measure with."""
    from probe.analysis.interventions import HeadImportance, Patching

    importance = None
    if args.importance == MEASURE:
        if from_caches:
            raise ProbeError(
                "--importance without a file measures head importance with the model: give --model NAME "
                "and texts, or a saved result (--importance result.json)"
            )
        metric_kwargs(args)  # refused before the model loads
    elif args.importance is not None:
        importance = HeadImportance.load(args.importance)
    patching = [Patching.load(p) for p in args.patching or []]
    return importance, patching or None


def cmd_report(args: argparse.Namespace) -> int:
    import probe

    inputs = list(args.inputs)
    model_given = bool(args.model or args.hf)
    if model_given and args.importance not in (None, MEASURE) and not args.importance.endswith(".json"):
        inputs.append(args.importance)  # --model minigpt --importance "text": the flag took the text
        args.importance = MEASURE
    if args.audio:
        return _report_audio(args, inputs)
    if args.image:
        return _report_images(args, inputs)
    if not inputs:
        raise ProbeError("nothing to report; give a cache file (run.safetensors) or --model NAME and a text")
    from_caches = not model_given and all(i.endswith(".safetensors") for i in inputs)
    from probe.capture.consumers.kept import parse_keep_arg

    keep = parse_keep_arg(args.keep) if args.keep is not None else None  # before loading the model
    if args.contributions and from_caches:
        raise ProbeError(
            "--contributions captures them from --model and a text; a cache file holds what it holds "
            "(capture one with probe.contributions)"
        )
    if keep is not None and from_caches:
        raise ProbeError(
            "--keep says what to capture from --model and a text; a cache file keeps what it kept"
        )
    if not from_caches and any(i.endswith(".safetensors") for i in inputs):
        raise ProbeError(
            "give either cache files (probe report run.safetensors) or texts with a model "
            "(probe report --model minigpt 'text'), not both"
        )
    if from_caches:
        name = Path(inputs[0]).stem
    else:
        name = common.model_label(args)
    out = Path(args.output) if args.output else Path("reports") / report_name(name)
    from probe.report.html import check_report_dir

    check_report_dir(out)  # before loading the model and running the forward
    gold = None
    if args.gold:  # read (and refused) before the model runs
        from probe.analysis.alignment import read_gold

        gold = read_gold(args.gold, one_indexed=args.one_indexed)
    importance, patching = _saved_results(args, from_caches)
    if from_caches:
        caches = [probe.load(i) for i in inputs]
        model = tok = None
    else:
        model, tok = common.load_model(args)
        text = inputs if len(inputs) > 1 else inputs[0]
        target = None
        if args.target is not None:
            target = args.target if len(args.target) > 1 else args.target[0]
        run = probe.contributions if args.contributions else probe.capture
        caches = [run(model, text, tokenizer=tok, target=target, keep=keep)]
        if args.importance == MEASURE:
            importance = probe.head_importance(
                model, text, how=args.how, tokenizer=tok, target=target, **metric_kwargs(args)
            )
    tutorial = _tutorial_cache(caches[0], model if not args.hf else None)
    path = probe.report(
        caches,
        out,
        model=model,
        tokenizer=tok,
        gold=gold,
        tutorial=tutorial,
        importance=importance,
        patching=patching,
    )
    print(
        f"wrote {path} ({human_size(path.stat().st_size)}); open it in a browser: {path.resolve().as_uri()}"
    )
    return 0


def _report_images(args: argparse.Namespace, inputs: list[str]) -> int:
    """``probe report --hf DIR --image PATH... [TEXT...]``: capture the pictures (with the texts a
    vision-language model reads beside them), then the report."""
    import probe
    from probe.capture.consumers.kept import parse_keep_arg
    from probe.report.html import check_report_dir

    if any(i.endswith(".safetensors") for i in inputs):
        raise ProbeError(
            "give --image pictures (and a TEXT for a vision-language model) or cache files, not both"
        )
    if args.importance or args.patching or args.gold or args.target:
        raise ProbeError(
            "--importance, --patching, --gold and --target are for texts; drop them with --image"
        )
    keep = parse_keep_arg(args.keep) if args.keep is not None else None
    out = _media_dir(args, args.image)
    check_report_dir(out)  # before loading the model and running the forward
    model, tok, processor = common.load_image_model(args, text=bool(inputs))
    prompt = (inputs if len(inputs) > 1 else inputs[0]) if inputs else None
    run = probe.contributions if args.contributions else probe.capture
    cache = run(model, args.image, tokenizer=tok, processor=processor, text=prompt, keep=keep)
    path = probe.report([cache], out, model=model, tokenizer=tok)
    print(
        f"wrote {path} ({human_size(path.stat().st_size)}); open it in a browser: {path.resolve().as_uri()}"
    )
    return 0


def _report_audio(args: argparse.Namespace, inputs: list[str]) -> int:
    """``probe report --hf DIR --audio PATH... [--target TEXT]``: capture the sound, then the report."""
    import probe
    from probe.capture.consumers.kept import parse_keep_arg
    from probe.report.html import check_report_dir

    audio.check_audio_args(args, inputs)
    if args.importance or args.patching or args.gold or args.contributions:
        raise ProbeError(
            "--importance, --patching, --gold and --contributions are for texts and pictures; drop them "
            "with --audio"
        )
    keep = parse_keep_arg(args.keep) if args.keep is not None else None
    out = _media_dir(args, args.audio)
    check_report_dir(out)  # before loading the model and running the forward
    model, tok, processor = audio.load_audio_model(args)
    cache = audio.capture_audio(args, model, tok, processor, keep=keep)
    path = probe.report([cache], out, model=model, tokenizer=tok)
    print(
        f"wrote {path} ({human_size(path.stat().st_size)}); open it in a browser: {path.resolve().as_uri()}"
    )
    return 0


def add_parser(sub) -> None:
    """``probe report``."""
    p = sub.add_parser(
        "report",
        help="write an offline HTML report (capture first when given a model and text)",
        description="Write one self-contained index.html (no network needed to view it): model and "
        "tokens, every head's attention (overview and explorer), cross-attention, the residual "
        "stream and the analyses. Give cache files, or a model and text to capture first. Two cache "
        "files are also shown side by side: per-head differences and their head explorers in step.",
        epilog=examples(
            "probe report --model minigpt 'attention lets tokens read.'",
            "probe report --model translator 'ich mochte ein bier P' --target 'S i want a beer'",
            "probe report run.safetensors -o reports/run",
            "probe report before.safetensors after.safetensors -o reports/diff",
            "probe report --hf ./my-bert 'some text'",
            "probe report --hf ./my-vit --image cat.png -o reports/cat",
            "probe report --model vit_zoo --image cat.png  # writes reports/vit_zoo-cat/",
            "probe report --hf ./my-whisper --audio talk.wav --target 'the words said'",
            "probe report --hf ./my-llava --image cat.png 'USER: <image> what is it?'",
            "probe report --model minigpt --keep stats 'a long text'",
            "probe report --model smollm2 --contributions 'The cat sat on the mat.'",
            "probe report --model minigpt 'attention lets tokens read.' --importance",
            "probe report run.safetensors --importance importance.json --patching heads.json",
        ),
    )
    p.add_argument(
        "inputs",
        nargs="*",
        metavar="CACHE_OR_TEXT",
        help="cache files (.safetensors), or texts to capture with --model/--hf (default model: minigpt)",
    )
    add_model_args(p)
    add_image_args(p)
    audio.add_audio_args(p)
    p.add_argument(
        "--target", "-t", nargs="+", default=None, help="decoder text for encoder-decoders (teacher forcing)"
    )
    p.add_argument(
        "-o",
        "--output",
        default=None,
        help="report folder (default: reports/<model>/ for texts, reports/<model>-<file name>/ for "
        "--image and --audio, reports/<cache name>/ for cache files)",
    )
    _add_shown_args(p)
    p.set_defaults(func=cmd_report)


def _add_shown_args(p) -> None:
    """What the report adds beyond the attention: gold alignments, what was kept, contributions,
    head importance and patching."""
    p.add_argument(
        "--gold",
        metavar="FILE",
        help="gold word alignments (Pharaoh/talp: i-j sure, ipj possible, one line per sentence pair): "
        "the alignment section marks them and maps AER per layer x head",
    )
    p.add_argument("--one-indexed", action="store_true", help="--gold counts words from 1")
    p.add_argument(
        "--keep",
        default=None,
        metavar="WHAT",
        help="what to capture of each attention (with --model/--hf): 'patterns' (default), 'stats' "
        "(each head's statistics computed while the model runs, for long texts), 'rows:-1' or "
        "'topk:32'; the report shows what was kept and says what was not",
    )
    p.add_argument(
        "--contributions",
        action="store_true",
        help="with --model/--hf: capture each head's contributions beside its weights "
        "(probe.contributions: the norm of what it writes from each key) and show them side by side",
    )
    p.add_argument(
        "--importance",
        nargs="?",
        const=MEASURE,
        default=None,
        metavar="FILE",
        help="add 'Which heads matter': a head importance saved with result.save(FILE), or, with no "
        "FILE and a model, measure it on the texts (each head removed in turn; see --how, --metric)",
    )
    p.add_argument("--how", choices=("zero", "mean"), default="zero", help="for --importance (default zero)")
    add_metric_args(p, "loss", "for --importance: ")
    p.add_argument(
        "--patching",
        nargs="+",
        default=None,
        metavar="FILE",
        help="patching results saved with result.save(FILE)",
    )
