"""What every ``probe`` command shares: ``--model``/``--hf`` and loading the model, ``--csv``/``--json``
exports, small argument parsers, and the error boundary (one line, exit 2, no traceback; signals
clean up like Ctrl-C).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from probe.errors import ProbeError


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` of every command: descriptions wrapped to the terminal like argparse does; an
    epilog with line breaks (the examples, :func:`examples`) kept as written, one per line."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def examples(*lines: str) -> str:
    """An epilog listing example command lines, one per line under "examples:"."""
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def int_list(text: str) -> list[int]:
    """``"0, 3,5"`` -> ``[0, 3, 5]`` (an argparse type: anything else is a usage error)."""
    try:
        return [int(p) for p in text.replace(" ", "").split(",") if p != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 0,2,5, got {text!r}"
        ) from None


def zoo_name(name: str) -> str:
    """A zoo model's name as ``probe models`` and ``models.load`` spell it: the shell's spelling
    with ``-`` (``vit-zoo``, ``fused-decoder``) is accepted for its ``_``; other names unchanged."""
    import models

    if name not in models.names() and name.replace("-", "_") in models.names():
        return name.replace("-", "_")
    return name


def _load_zoo(name: str):
    import models

    name = zoo_name(name)
    if name not in models.names():
        raise ProbeError(
            f"unknown model {name!r}; choose one of: {', '.join(models.names())} (see `probe models`)"
        )
    return models.load(name)


def model_label(args: argparse.Namespace) -> str:
    """The model a command's output folder is named after: the ``--hf`` folder's name, else the zoo
    name (as ``probe models`` spells it)."""
    if getattr(args, "hf", None):
        return Path(args.hf).name
    return zoo_name(args.model or args.default_model or "model")


def add_model_args(p: argparse.ArgumentParser, *, default: str | None = "minigpt") -> None:
    """``--model NAME`` (zoo) and ``--hf PATH`` (a local Hugging Face model folder), one of them."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--model", "-m", default=None, help=f"zoo model name (see `probe models`; default: {default})"
    )
    g.add_argument("--hf", metavar="PATH", default=None, help="a local Hugging Face model folder (offline)")
    p.set_defaults(default_model=default)


def load_model(args: argparse.Namespace, writes: bool = False):
    """The model named by ``--model`` / ``--hf``; returns ``(model, tokenizer)`` in eval mode.
    ``writes``: a ``--hf`` vision-language model is loaded with its language head (to generate),
    else as the model ``AutoModel`` gives (its stacks named as a capture of it names them)."""
    if getattr(args, "hf", None):
        return _load_hf(args.hf, writes)
    name = args.model or args.default_model
    if name is None:
        raise ProbeError("no model given; pass --model NAME (see `probe models`) or --hf PATH")
    model = _load_zoo(name)
    return model, model.tokenizer


def _load_hf(path: str, writes: bool = False):
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
    speech = transformers.models.auto.modeling_auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES
    if config.model_type in speech:  # Whisper, Speech2Text, Moonshine: audio in, text out
        auto = transformers.AutoModelForSpeechSeq2Seq
    elif getattr(config, "is_encoder_decoder", False):
        auto = transformers.AutoModelForSeq2SeqLM
    elif any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in (config.architectures or [])):
        auto = transformers.AutoModelForCausalLM
    elif (
        writes
        and config.model_type
        in transformers.models.auto.modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    ):
        auto = transformers.AutoModelForImageTextToText  # a vision-language model, with its LM head
    try:
        tok = _hf_tokenizer(transformers, folder)
        model = auto.from_pretrained(folder).eval()
    except (OSError, ValueError) as e:
        raise ProbeError(f"--hf {path}: could not load ({str(e).splitlines()[0]})") from None
    return model, tok


def _hf_tokenizer(transformers, folder: Path):
    """The folder's tokenizer; None for a folder with no tokenizer files (an image model's)."""
    files = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model")
    if not any((folder / f).is_file() for f in files) and not list(folder.glob("*.model")):
        return None
    return transformers.AutoTokenizer.from_pretrained(folder)


def add_image_args(
    p: argparse.ArgumentParser, help: str = "a picture to capture (several = one batch)"
) -> None:
    """``--image PATH`` (several allowed) and ``--processor NAME_OR_PATH``."""
    p.add_argument("--image", action="append", default=None, metavar="PATH", help=help)
    p.add_argument(
        "--processor",
        default=None,
        metavar="PATH",
        help="the model's image processor: a local folder with preprocessor_config.json "
        "(default: the --hf folder's own)",
    )


def load_image_model(args: argparse.Namespace, text: bool = False, writes: bool = False):
    """``(model, tokenizer, processor)`` for ``--image``: a ``--hf`` folder's model with its image
    processor (or ``--processor PATH``), refused before the model loads; a zoo image model
    (``--model vit_zoo``) with its own ``processor`` unless ``--processor`` is given. With
    ``text`` (pictures with a text, for a vision-language model) the folder's whole processor."""
    if getattr(args, "hf", None) or args.processor:
        processor = load_processor(args, text)
        model, tok = load_model(args, writes)
        return model, tok, processor
    model, tok = load_model(args, writes)
    processor = getattr(model, "processor", None)
    if processor is None:
        raise ProbeError(
            f"--image needs an image model: zoo model {getattr(model, 'name', '?')} reads text; give "
            "--model vit_zoo, or --hf PATH with an image model"
        )
    return model, tok, processor


def load_processor(args: argparse.Namespace, text: bool = False):
    """The image processor for ``--image``: ``--processor PATH``, else the ``--hf`` folder's own;
    with ``text``, the vision-language processor (image processor and tokenizer) saved there."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = args.processor or getattr(args, "hf", None)
    if text:
        return _vlm_processor(path)
    if path is None or not (Path(path) / "preprocessor_config.json").is_file():
        where = f"{path} has no preprocessor_config.json" if path else "no processor given"
        raise ProbeError(
            f"--image needs the model's image processor ({where}); give --processor PATH, a local "
            "folder with preprocessor_config.json"
        )
    import transformers

    try:
        return transformers.AutoImageProcessor.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ProbeError(f"--processor {path}: could not load ({str(e).splitlines()[0]})") from None


def _vlm_processor(path: str | None):
    """``AutoProcessor.from_pretrained(path)`` for pictures with a text: a folder with the
    processor a vision-language model saves (``processor_config.json``), refused in one line."""
    if path is None or not (Path(path) / "processor_config.json").is_file():
        where = f"{path} has no processor_config.json" if path else "no processor given"
        raise ProbeError(
            f"--image with a TEXT needs the vision-language model's processor ({where}); give "
            "--processor PATH, a folder where the processor was saved (processor.save_pretrained)"
        )
    import transformers

    try:
        return transformers.AutoProcessor.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ProbeError(f"--processor {path}: could not load ({str(e).splitlines()[0]})") from None


def write_exports(result, args: argparse.Namespace) -> None:
    """Write ``--csv``/``--json`` exports of a result (atomically) and say where."""
    for fmt in ("csv", "json"):
        path = getattr(args, fmt, None)
        if path:
            getattr(result, f"to_{fmt}")(path)
            print(f"wrote {path}")


def _check_exports(args: argparse.Namespace) -> None:
    """``--csv FILE``/``--json FILE`` checked before the command runs (not after the work is done)."""
    from probe.files import check_writable

    for attr, example in (("csv", "table.csv"), ("json", "result.json")):
        path = getattr(args, attr, None)
        if isinstance(path, str):  # `probe stats --json` is a flag (print JSON), not a file
            check_writable(path, example)


def add_export_args(p: argparse.ArgumentParser, what: str) -> None:
    """``--csv`` and ``--json``, the exports :func:`write_exports` writes."""
    p.add_argument("--csv", default=None, help=f"also write {what} to this CSV file")
    p.add_argument("--json", default=None, help=f"also write {what} to this JSON file")


# -- the error boundary --------------------------------------------------------------------------------------
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


def run(args: argparse.Namespace) -> int:
    """Run the parsed command ``args.func(args)`` inside the one error boundary; returns the exit code.

    A :class:`ProbeError` or ``OSError`` becomes one line on stderr and exit code 2; a closed output
    pipe exits quietly (0); Ctrl-C exits 130 and SIGTERM/SIGHUP 128 + the signal number, each after
    the temporary files are removed.
    """
    import signal

    from probe import interrupt
    from probe.errors import describe_os_error

    old = _catch_signals()
    previous_int = interrupt.install()
    try:
        _check_exports(args)
        code = args.func(args)
        interrupt.check()  # a Ctrl-C swallowed where it landed (in a __del__) still stops with 130
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
        interrupt.restore(previous_int)
        for sig, handler in old.items():
            signal.signal(sig, handler)
