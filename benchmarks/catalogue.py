"""The catalogue sweep: every model type of the installed ``transformers``, built tiny, captured by
probe on its default attention implementation and compared with eager ``output_attentions``
(and a softmax of the arguments handed to SDPA), one verdict per family.

    PYTHONPATH=$PWD python benchmarks/catalogue.py --out catalogue.json --jobs 2 --timeout 120
    PYTHONPATH=$PWD python benchmarks/catalogue.py --only gpt2,bert,t5
    PYTHONPATH=$PWD python benchmarks/catalogue.py --markdown catalogue.json > docs/catalogue.md

Models run in worker subprocesses with a per-model timeout (a hang kills its worker, which is
replaced); results are written to ``--out`` after every model, and a rerun skips the model types
already there (``--redo`` reruns them). The verdicts are those of ``tests/catalogue_check.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def one(model_type: str) -> dict:
    """Build, run and check one model type; the verdict as a dict (never raises). ``image`` is True
    for a family whose forward takes pixels (run on pixels, and image tokens in its text, made from
    its config by ``tests/catalogue_inputs.py``; ``inputs`` names their shapes), ``audio`` for one
    run on audio (a spectrogram or a waveform made from its config by ``tests/catalogue_audio.py``)."""
    import catalogue_configs as K
    import catalogue_inputs as I
    from catalogue_classify import classify_build_error, other_input

    t0 = time.time()
    cls = None
    image: dict = {}
    try:
        cls = K.model_class(K.tiny_config(model_type))
        image = _kind(cls)
        if cls is not None and "input_ids" not in I.forward_params(cls) and not image:
            # decided before building: time series, video, ... take neither ids, pixels nor audio
            return {"status": "cannot run", "reason": I.not_image(cls)}
        model = K.build(model_type)
    except Exception as e:  # noqa: BLE001
        return {**classify_build_error(model_type, e, cls), **image}
    res = I.check_family(model)
    if res["status"] == "run failed":
        res = other_input(res)  # a forward that asks for layout boxes, visual features, ...
    res["class"] = type(model).__name__
    res["seconds"] = round(time.time() - t0, 2)
    return {**res, **image}


def _kind(cls) -> dict:
    """``{"image": True}`` for a forward that takes pixels, ``{"audio": True}`` for one run on audio
    (``tests/catalogue_audio.py``), else ``{}``."""
    import catalogue_audio as A
    import catalogue_inputs as I

    if cls is not None and I.takes_pixels(cls):
        return {"image": True}
    audio = cls is not None and (A.takes_audio(cls) or A.takes_audio_text(cls))
    return {"audio": True} if audio else {}


def worker() -> None:
    """Read model types on stdin, write one JSON verdict line each on the real stdout."""
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever models print goes to stderr
    import catalogue_check  # noqa: F401 - imports (torch, transformers, probe) before the clock starts
    import transformers  # noqa: F401

    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        mt = line.strip()
        if mt:
            out.write(json.dumps({"model_type": mt, **one(mt)}) + "\n")
            out.flush()


def all_model_types() -> list[str]:
    import transformers as tf

    text = set()
    for name in ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"):
        text |= set(getattr(tf.models.auto.modeling_auto, name, {}))
    text |= set(getattr(tf.models.auto.modeling_auto, "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", {}))
    # language models first: a sweep cut short has done the families that matter most
    return sorted(tf.CONFIG_MAPPING.keys(), key=lambda mt: (mt not in text, mt))


class Results:
    """The JSON results file: {model_type: verdict}, rewritten atomically after every verdict."""

    def __init__(self, path: Path) -> None:
        self.path, self.lock = path, threading.Lock()
        self.data = json.loads(path.read_text()) if path.exists() else {}

    def put(self, mt: str, verdict: dict) -> None:
        with self.lock:
            self.data[mt] = verdict
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".catalogue-")
            with os.fdopen(fd, "w") as f:
                json.dump(self.data, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)


def _start(log) -> tuple[subprocess.Popen, queue.Queue]:
    p = subprocess.Popen(
        [sys.executable, __file__, "--worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path[:2])},
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in p.stdout] + [lines.put(None)], daemon=True).start()
    lines.get(timeout=900)  # the worker's "ready" (imports done): the per-model clock starts after it
    return p, lines


def _slot(todo: queue.Queue, results: Results, timeout: float, log) -> None:
    p, lines = _start(log)
    while True:
        try:
            mt = todo.get_nowait()
        except queue.Empty:
            break
        p.stdin.write(mt + "\n")
        p.stdin.flush()
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            line = None
            verdict = {"status": "timeout", "reason": f"no verdict within {timeout:.0f} s"}
        else:
            verdict = json.loads(line) if line else {"status": "crash", "reason": "the worker process died"}
            verdict.pop("model_type", None)
        results.put(mt, verdict)
        print(f"{mt:32s} {verdict['status']:22s} {verdict.get('reason', '')[:90]}", flush=True)
        if line is None:
            p.kill()
            p.wait()
            p, lines = _start(log)
    p.stdin.close()
    p.wait()


def sweep(types: list[str], out: Path, jobs: int, timeout: float, redo: bool) -> Results:
    results = Results(out)
    todo: queue.Queue = queue.Queue()
    for mt in types:
        if redo or mt not in results.data:
            todo.put(mt)
    with open(out.with_suffix(".log"), "a") as log:
        threads = [threading.Thread(target=_slot, args=(todo, results, timeout, log)) for _ in range(jobs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--only", help="comma-separated model types (default: every one in transformers.CONFIG_MAPPING)"
    )
    ap.add_argument("--out", default="catalogue.json", help="the JSON results file (resumed if it exists)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    ap.add_argument(
        "--timeout", type=float, default=120.0, help="seconds per model before its worker is killed"
    )
    ap.add_argument("--redo", action="store_true", help="rerun model types already in --out")
    ap.add_argument("--markdown", metavar="JSON", help="print the docs page for the results in JSON and exit")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker()
        return 0
    if a.markdown:
        from catalogue_markdown import page

        print(page(json.loads(Path(a.markdown).read_text())))
        return 0
    types = a.only.split(",") if a.only else all_model_types()
    results = sweep(types, Path(a.out), max(1, a.jobs), a.timeout, a.redo)
    counts: dict[str, int] = {}
    for mt in types:
        s = results.data.get(mt, {}).get("status", "missing")
        counts[s] = counts.get(s, 0) + 1
    print(json.dumps(counts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
