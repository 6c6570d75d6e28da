"""``probe corpus``: capture many texts (pictures, sounds), bounded memory, resumable, torchrun-aware."""

from __future__ import annotations

import argparse

from probe.cli import common
from probe.cli.audio import load_audio_model
from probe.cli.common import add_model_args, examples
from probe.errors import ProbeError
from probe.files import input_file


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
    if sum(x is not None for x in (args.texts, args.images, args.audio)) != 1:
        raise ProbeError(
            "give --texts FILE, --images FOLDER_OR_FILES or --audio FOLDER_OR_FILES (one of them)"
        )
    if args.audio is not None and (args.text is not None or args.field is not None):
        raise ProbeError("--text and --field are for pictures and texts; drop them with --audio")
    if args.texts is not None:
        if args.processor:
            raise ProbeError(
                "--processor reads pictures or sound; give --images or --audio with it, or drop it"
            )
        if args.text is not None:
            raise ProbeError("--text is read beside --images pictures; with --texts FILE drop it")
        input_file(args.texts, "--texts", "give a .txt (one text per line) or .jsonl file")
    from probe.corpus.run import check_run_dir

    check_run_dir(args.output)  # before loading the model
    processor = None
    if args.audio is not None:
        inputs = _files(args.audio, "--audio", "sound")
        model, tok, processor = load_audio_model(args)
    elif args.images is not None:
        inputs = _files(args.images, "--images", "image")
        if args.field is not None:
            raise ProbeError("--field names a JSONL field of texts; drop it with --images")
        try:
            model, tok, processor = common.load_image_model(args, text=args.text is not None)
        except ProbeError as e:  # its messages name capture's --image; this command's flag is --images
            raise ProbeError(str(e).replace("--image ", "--images ")) from None
    else:
        inputs = args.texts
        model, tok = common.load_model(args)
    corpus = run_corpus(
        model,
        inputs,
        args.output,
        tokenizer=tok,
        processor=processor,
        text=args.text,
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


def _files(paths: list[str], flag: str, kind: str) -> str | list[str]:
    """``--images`` / ``--audio``: one folder (its image or sound files, sorted by name) or files."""
    from pathlib import Path

    folders = [p for p in paths if Path(p).is_dir()]
    if folders and len(paths) > 1:
        raise ProbeError(f"{flag}: give one folder ({folders[0]}) or {kind} files, not both")
    return folders[0] if folders else list(paths)


def add_parser(sub) -> None:
    """``probe corpus``."""
    p = sub.add_parser(
        "corpus",
        help="capture a corpus: bounded memory, resumable, torchrun-aware",
        description="Run a model over many texts (or pictures, --images, or sounds, --audio): shards of "
        "cache files (or statistics only), a manifest mapping every text to its shard and row (or its "
        "error), and merged per-head statistics (head_stats.json/.csv). Rerun the same command to "
        "resume; launch it with `torchrun --nproc_per_node=N -m probe corpus ...` to share the shards "
        "between processes.",
        epilog=examples(
            "probe corpus --model minigpt --texts texts.txt -o run/",
            "probe corpus --hf ./gpt2 --texts data.jsonl --field text -o run/ --layers 0 5 --heads 1 2",
            "torchrun --nproc_per_node=2 -m probe corpus --model minigpt --texts texts.txt -o run/",
            "probe corpus --hf ./vit --images pictures/ -o run/  # the folder's preprocessor_config.json",
            "probe corpus --hf ./llava --images pictures/ --text 'USER: <image> what is it?' -o run/",
            "probe corpus --model speech --audio recordings/ -o run/  # a zoo speech model's own processor",
        ),
    )
    add_model_args(p, default=None)
    p.add_argument("--texts", metavar="FILE", default=None, help="one text per line, or JSONL with --field")
    p.add_argument(
        "--images",
        nargs="+",
        default=None,
        metavar="FOLDER_OR_FILES",
        help="pictures instead of texts: a folder (every image file in it, sorted by name) or image files",
    )
    p.add_argument(
        "--audio",
        nargs="+",
        default=None,
        metavar="FOLDER_OR_FILES",
        help="sounds instead of texts: a folder (every sound file in it, sorted by name) or sound files "
        "(WAV, FLAC, OGG, MP3; needs the audio extra)",
    )
    p.add_argument(
        "--processor",
        default=None,
        metavar="DIR",
        help="the model's image processor for --images, or feature extractor for --audio: a folder with "
        "preprocessor_config.json (default: the --hf folder's own, or a zoo model's)",
    )
    p.add_argument(
        "--text",
        default=None,
        metavar="TEXT",
        help="what a vision-language model reads beside each of the --images pictures (with the "
        "processor's image token, e.g. '<image>', where the picture goes)",
    )
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
