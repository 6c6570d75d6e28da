"""Benchmark: what scoring every edge of a circuit costs against one forward and backward, in one process.

Issue 55 item 8: EAP scores for 64 IOI prompts on SmolLM2-135M within 3x the time of one forward
plus backward of the same batch, EAP-IG with m steps within (m + 2)x. The task (graph, hooks,
prepared chunks) is built once; then, interleaved round-robin (every repeat times all modes back
to back, so the machine's drift hits them alike):

* ``fwd+bwd``: the model on the clean batch, the metric, ``backward()`` (the baseline; the
  parameters' gradients, as in training), and ``fwd+bwd inputs``: the gradient to the token
  embeddings alone (no weight gradients: the cheapest backward, shown beside it);
* ``eap``: every edge's EAP score (one corrupted forward, one clean forward and backward, the
  gradients through each target's own block and norm, the contraction with the output
  differences);
* ``eap-ig``: EAP-IG with ``--steps`` steps.

    python benchmarks/circuit.py                          # SmolLM2, 64 IOI prompts, m = 5
    python benchmarks/circuit.py --model induction --prompts 8 --repeats 1   # a quick run
    python benchmarks/circuit.py --model minigpt --prompts 8 --repeats 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import models
from probe.intervene.circuit import induction_prompts, ioi_prompts
from probe.intervene.circuit.attribute import eap_scores
from probe.intervene.circuit.build import wire
from probe.intervene.circuit.inputs import Examples
from probe.intervene.circuit.metrics import make_metric
from probe.intervene.circuit.task import Task


def build_task(name: str, n: int, batch_size: int) -> tuple[Task, str]:
    model = models.load(name).eval()
    if name == "induction":
        from models.induction import CHARS

        ps = induction_prompts(n, CHARS[1:], seed=0)  # CHARS[0] is the beginning-of-sequence token
        what = f"{n} induction prompts"
    elif name == "minigpt":  # a small trained LM: the same task on its letters (a quick check)
        ps = induction_prompts(n, "acdefghiklmnoprstuwx", half=12, shown=6, bos=None, seed=0)
        what = f"{n} repeated-letter prompts"
    else:
        ps = ioi_prompts(n, model.tokenizer, seed=0)
        what = f"{n} IOI prompts"
    clean, corrupt = Examples(ps.clean), Examples(ps.corrupted)
    metric = make_metric("logit-diff", ps.answers, n, model=model, tokenizer=model.tokenizer)
    options = {"tokenizer": model.tokenizer}
    task = Task(model, wire(model, clean, options), clean, corrupt, metric, options, batch_size)
    task.pairs()
    return task, what


def forward_backward(task: Task, inputs_only: bool = False) -> None:
    """The baseline: the clean batch forward, the metric, and ``backward()`` (the parameters'
    gradients, as in training) or, ``inputs_only``, the gradient to the token embeddings alone."""
    model = task.model
    emb = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding))
    kept = []

    def leaf(mod, args, out):
        kept.append(out.detach().requires_grad_(True))
        return kept[-1]

    hook = emb.register_forward_hook(leaf) if inputs_only else None
    try:
        for clean, _ in task.pairs():
            with torch.enable_grad():
                out = clean.run()
                logits = getattr(out, "logits", out[0] if isinstance(out, tuple) else out)
                m = task.metric.rows(logits, task.last(logits, clean), clean.examples).sum() / task.n
                if inputs_only:
                    torch.autograd.grad(m, kept[-1])
                else:
                    m.backward()
    finally:
        if hook is not None:
            hook.remove()
    model.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default="smollm2", choices=("smollm2", "induction", "minigpt"), help="default smollm2"
    )
    ap.add_argument("--prompts", type=int, default=64, help="prompts (default 64)")
    ap.add_argument("--batch-size", type=int, default=None, help="prompts per chunk (default: all at once)")
    ap.add_argument("--steps", type=int, default=5, help="EAP-IG steps m (default 5)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per mode (default 3)")
    args = ap.parse_args(argv)
    task, what = build_task(args.model, args.prompts, args.batch_size or args.prompts)
    modes = {
        "fwd+bwd": lambda: forward_backward(task),
        "fwd+bwd inputs": lambda: forward_backward(task, inputs_only=True),
        "eap": lambda: (task.forget(), eap_scores(task, 1)),  # the corrupted run included
        f"eap-ig m={args.steps}": lambda: (task.forget(), eap_scores(task, args.steps)),
    }
    for run in modes.values():  # warm-up
        run()
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode, run in modes.items():
            t = time.perf_counter()
            run()
            times[mode].append(time.perf_counter() - t)
    g = task.wiring.graph
    base = statistics.median(times["fwd+bwd"])
    print(
        f"circuit scoring, {args.model}, {what} in chunks of {task.batch_size}, {len(g.nodes)} nodes, "
        f"{len(g.targets)} targets, {g.n_edges} edges; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {args.repeats} repeats (median)"
    )
    limits = {"eap": 3.0, f"eap-ig m={args.steps}": args.steps + 2.0}
    inputs = statistics.median(times["fwd+bwd inputs"])
    print(f"{'mode':15} {'seconds':>9} {'x fwd+bwd':>10} {'x inputs only':>14} {'target':>8}")
    for mode in modes:
        med = statistics.median(times[mode])
        lim = limits.get(mode)
        target = "" if lim is None else f"<= {lim:g}"
        print(f"{mode:15} {med:9.3f} {med / base:10.2f} {med / inputs:14.2f} {target:>8}")
    print(
        "fwd+bwd: backward() to the parameters, as in training; inputs only: the gradient to the embeddings"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
