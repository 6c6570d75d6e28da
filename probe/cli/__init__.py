"""The ``probe`` command line: ``probe capture``, ``probe info``, ``probe report``, ``probe models``, ...

Problems the user can fix are printed as one line (``probe: error: ...``) with exit code 2 and
no traceback; nothing half-written is left behind.

One module per command group (``capture`` also holds ``info`` and ``models``; ``residual`` holds
``lens`` and ``budget``); what they share (``--model``/``--hf``, exports, the error boundary) is in
``common``. Each module imports its heavy dependencies inside its command, so ``probe --help``
stays fast.
"""

from __future__ import annotations

import argparse

from probe.cli import (
    align,
    capture,
    check,
    circuit,
    common,
    corpus,
    diff,
    export,
    generate,
    intervene,
    report,
    residual,
    serve,
    stats,
)
from probe.cli.align import align_text, cmd_align
from probe.cli.capture import cmd_capture, cmd_info, cmd_models, info_text
from probe.cli.check import cmd_check
from probe.cli.circuit import cmd_circuit
from probe.cli.common import Terminated, add_model_args, load_model
from probe.cli.corpus import cmd_corpus
from probe.cli.diff import cmd_diff
from probe.cli.export import cmd_export
from probe.cli.generate import cmd_generate
from probe.cli.intervene import cmd_ablate, cmd_patch
from probe.cli.report import cmd_report
from probe.cli.residual import cmd_budget, cmd_lens, cmd_residual
from probe.cli.serve import cmd_serve
from probe.cli.stats import cmd_stats

__all__ = [
    "Terminated",
    "add_model_args",
    "align_text",
    "build_parser",
    "cmd_ablate",
    "cmd_align",
    "cmd_budget",
    "cmd_capture",
    "cmd_check",
    "cmd_circuit",
    "cmd_corpus",
    "cmd_diff",
    "cmd_export",
    "cmd_generate",
    "cmd_info",
    "cmd_lens",
    "cmd_models",
    "cmd_patch",
    "cmd_report",
    "cmd_residual",
    "cmd_serve",
    "cmd_stats",
    "info_text",
    "load_model",
    "main",
]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``probe`` command."""
    parser = argparse.ArgumentParser(
        prog="probe",
        description="See what attention inside a transformer really does: capture every "
        "attention pattern and residual delta into a safetensors cache.",
        epilog=common.examples(
            "probe models",
            "probe report --model minigpt 'attention lets tokens read.'",
            "probe capture --model minigpt 'attention lets tokens read.' -o run.safetensors",
            "probe COMMAND --help",
        ),
        formatter_class=common.HelpFormatter,
    )
    from probe.version import __version__

    parser.add_argument("--version", action="version", version=f"probe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    # in this order in `probe --help`
    capture.add_capture_parser(sub)
    capture.add_info_parser(sub)
    corpus.add_parser(sub)
    serve.add_parser(sub)
    check.add_parser(sub)
    report.add_parser(sub)
    generate.add_parser(sub)
    diff.add_parser(sub)
    export.add_parser(sub)
    stats.add_parser(sub)
    capture.add_models_parser(sub)
    residual.add_parsers(sub)
    align.add_parser(sub)
    intervene.add_parsers(sub)
    circuit.add_parser(sub)
    for p in sub.choices.values():  # every command's --help: wrapped text, examples one a line
        p.formatter_class = common.HelpFormatter
    parser.commands = sub.choices  # name -> the command's parser (for its own usage in errors)
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line; a flag the command does not know is reported with that command's
    usage (``probe report --bogus``), not the top-level one; exits 2 like argparse."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``probe`` console script; returns the exit code.

    The one error boundary (:func:`probe.cli.common.run`): a :class:`ProbeError` or ``OSError``
    becomes one line on stderr and exit code 2; a closed output pipe exits quietly (0); Ctrl-C
    exits 130 and SIGTERM/SIGHUP 128 + the signal number, each after the temporary files are removed.
    """
    return common.run(parse(argv))
