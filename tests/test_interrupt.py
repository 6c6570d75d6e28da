"""Ctrl-C is never lost: an interrupt that Python swallows where it landed (inside a ``__del__``)
still stops a command with exit 130, and stops a corpus run before its next batch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

import probe
from models import load as load_model
from probe import interrupt

SCRIPT = textwrap.dedent(
    """
    import argparse, gc, os, signal, sys
    from probe.cli.common import run

    class Freed:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)  # lands here: Python prints it and goes on
            for _ in range(1000):
                pass

    def work(args):
        Freed()
        gc.collect()
        print("finished", flush=True)
        return 0

    sys.exit(run(argparse.Namespace(func=work, csv=None, json=None)))
    """
)


def test_a_ctrl_c_swallowed_in_a_destructor_still_exits_130():
    # SIGINT back to its default in the child: a shell's background job (`.ci/run &`) starts with it
    # ignored, and the child would inherit that and never see the interrupt
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # the work ran to its end (the interrupt was swallowed), yet the command reports it
    assert "finished" in r.stdout
    assert "Exception ignored" in r.stderr  # Python's own note: the interrupt was swallowed
    assert r.returncode == 130, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "probe: interrupted"


def test_a_pending_interrupt_stops_a_corpus_before_its_next_batch(tmp_path):
    texts = ["a cat reads the list." + " a" * i for i in range(12)]
    previous = interrupt.install()
    if previous is None:
        pytest.skip("SIGINT has a custom handler in this process")
    try:
        with pytest.raises(KeyboardInterrupt):
            interrupt.on_sigint(signal.SIGINT, None)  # what a swallowed Ctrl-C leaves behind
        with pytest.raises(KeyboardInterrupt):
            probe.run_corpus(
                load_model("minigpt"), texts, tmp_path / "run", batch_size=4, shard_size=4, progress=False
            )
    finally:
        interrupt.restore(previous)
    shards = sorted(p.name for p in (tmp_path / "run" / "shards").glob("*.json"))
    assert shards == [] and not (tmp_path / "run" / "manifest.json").exists()
    assert not [p for p in (tmp_path / "run").rglob("*") if p.name.endswith(".tmp")]
    # nothing pending afterwards: the same run now completes
    probe.run_corpus(
        load_model("minigpt"), texts, tmp_path / "run", batch_size=4, shard_size=4, progress=False
    )
    assert (tmp_path / "run" / "manifest.json").exists()
    assert os.path.exists(tmp_path / "run" / "shards" / "00002.json")
