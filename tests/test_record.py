"""probe.capture.hooks.record: the pattern-consumer seam. A consumer that never holds a whole pattern
(the per-row maximum weight, read row block by row block) gets every attention of the forward.

Oracles: the weights the toy's softmax attention keeps itself, and for SDPA the textbook
softmax(q kᵀ / √d) over the causal triangle, computed here in float64 from the module's own q, k.
"""

from __future__ import annotations

import pytest
import torch
from toys import ToyLM

from probe.cache.writer import MemorySink
from probe.capture.engine.tracer import Tracer
from probe.capture.patterns import sdpa_blocks


class RowMax:
    """Keeps, per attention, the largest weight of each query row: ``[batch, heads, q]``."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []
        self.closed: list[tuple[str, str]] = []

    def weights(self, attn, pattern, impl):
        attn.parts.append(pattern.amax(-1))

    def sdpa(self, attn, args, kwargs):
        attn.parts.append(torch.cat([b.amax(-1) for _, _, b in sdpa_blocks(*args, **kwargs, chunk=4)], -1))

    def close(self, attn):
        self.rows.append(torch.cat(attn.parts, -2) if len(attn.parts) > 1 else attn.parts[0])
        self.closed.append((attn.role, ",".join(sorted(attn.impl))))


def _oracle_row_max(lm, ids):
    """Per layer, the causal softmax of each attention's own q and k (float64), its row maxima."""
    inputs = []
    hooks = [b.attn.register_forward_pre_hook(lambda m, a: inputs.append(a[0])) for b in lm.blocks]
    with torch.no_grad():
        lm(ids)
    for h in hooks:
        h.remove()
    out = []
    for block, x in zip(lm.blocks, inputs, strict=True):
        q, k, _ = block.attn.qkv(x)
        s = (q.double() @ k.double().transpose(-2, -1)) / block.attn.hd**0.5
        T = s.shape[-1]
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        out.append(torch.softmax(s, -1).amax(-1).float())
    return out


@pytest.mark.parametrize("kind", ["sdpa_causal", "F.softmax"])
def test_a_consumer_gets_every_attention_and_stores_nothing(kind):
    torch.manual_seed(0)
    lm = ToyLM(kind, n_layers=3).eval()
    ids = torch.randint(0, 40, (2, 11))
    want = _oracle_row_max(lm, ids)
    consumer = RowMax()
    sink = MemorySink()
    with torch.no_grad(), Tracer(lm, sink, consumer=consumer) as tracer:
        lm(ids)
    assert consumer.closed == [("self", "sdpa" if kind == "sdpa_causal" else "softmax")] * 3
    for got, expect in zip(consumer.rows, want, strict=True):
        assert got.shape == (2, 4, 11)
        torch.testing.assert_close(got, expect, atol=1e-6, rtol=0)
    if kind == "F.softmax":  # the model's own weights agree too
        for got, block in zip(consumer.rows, lm.blocks, strict=True):
            assert torch.equal(got, block.attn.weights.amax(-1))
    # the layers and their residuals are recorded as ever; no pattern was stored
    assert [r.index for r in tracer.records] == [0, 1, 2]
    assert all(r.patterns == [] for r in tracer.records)
    assert [n for n, _ in tracer.records[0].residuals] == [
        "resid_pre",
        "self_attn.delta",
        "mlp.delta",
        "resid_post",
    ]
