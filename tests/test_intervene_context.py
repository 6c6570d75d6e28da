"""probe.intervene, the context manager: inside the block every forward runs edited (checked
against edits written here: a pre-hook on the output projection, a causal mask edited by hand
in a copy of the model); after it the model's outputs are bit-identical and no hook is left;
blocks do not nest."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import hf_fixtures as hf  # noqa: E402

import models  # noqa: E402
import probe  # noqa: E402
from probe.errors import ProbeError  # noqa: E402

TOL = dict(rtol=0, atol=1e-6)


def _zero_slice(module, head, d_head):
    def hook(mod, args):
        x = args[0].clone()
        x[..., head * d_head : (head + 1) * d_head] = 0
        return (x,) + args[1:]

    return module.register_forward_pre_hook(hook)


def _hooks(model):
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._forward_hooks_with_kwargs)
        for m in model.modules()
    )


@pytest.fixture(scope="module")
def minigpt():
    return models.load("minigpt")


def _twin(model, T):
    """A copy of minigpt with head L1.H2's own causal mask hiding keys 10-20 from the last query
    (of a T-token input), and head L0.H1 zeroed at L0's projection."""
    twin = copy.deepcopy(model)
    twin.blocks[1].attn.heads[2].tril[T - 1, 10:21] = 0
    _zero_slice(twin.blocks[0].attn.proj, 1, 16)
    return twin


def test_every_forward_inside_is_edited_and_after_it_nothing_is(minigpt):
    tok = minigpt.tokenizer
    ids = torch.tensor([tok.encode("attention lets tokens read")])
    other = torch.tensor([tok.encode("tokens read attention. lets")[:24]])  # another length
    with torch.no_grad():
        before, before_other = minigpt(ids)[0], minigpt(other)[0]
    n_hooks = _hooks(minigpt)
    knock = {"edges": [(-1, range(10, 21))], "layers": [1], "heads": [2]}
    with probe.intervene(minigpt, ids, ablate=[(0, 1)], knockout=knock) as iv, torch.no_grad():
        inside, inside_other = minigpt(ids)[0], minigpt(other)[0]
    with torch.no_grad():
        want, want_other = _twin(minigpt, ids.shape[1])(ids)[0], _twin(minigpt, other.shape[1])(other)[0]
        after, after_other = minigpt(ids)[0], minigpt(other)[0]
    torch.testing.assert_close(inside, want, **TOL)
    torch.testing.assert_close(inside_other, want_other, **TOL)
    assert torch.equal(iv.outputs[0], inside) and torch.equal(iv.clean[0], before)
    assert (inside - before).abs().max() > 1e-3
    assert torch.equal(after, before) and torch.equal(after_other, before_other)
    assert _hooks(minigpt) == n_hooks
    assert iv.ablated.column("component") == ["decoder.L0.H1"]
    assert iv.knocked.rows == [{"stack": "decoder", "layer": 1, "role": "self", "head": 2, "ops": 1}]


def test_the_plain_functions_are_the_block_run_once(minigpt):
    ids = torch.tensor([minigpt.tokenizer.encode("attention lets tokens read")])
    with probe.intervene(minigpt, ids, ablate=[(1, 3)], sublayers=[(0, "mlp")], how="mean"), torch.no_grad():
        inside = minigpt(ids)[0]
    r = probe.ablate(minigpt, ids, [(1, 3)], sublayers=[(0, "mlp")], how="mean")
    assert torch.equal(r.outputs[0], inside)
    with probe.intervene(minigpt, ids, knockout=[(-1, [0, 1, 2])]), torch.no_grad():
        inside = minigpt(ids)[0]
    k = probe.knockout(minigpt, ids, [(-1, [0, 1, 2])])
    assert torch.equal(k.outputs[0], inside) and len(k.table) == 2 * 4


def test_gpt2_sdpa_inside_equals_hooks_written_here():
    model = hf.gpt2(100)
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    h = model.transformer.h
    with torch.no_grad():
        before = model(ids).logits
    with probe.intervene(model, ids, ablate=[(0, 2), (2, 1)]), torch.no_grad():
        inside = model(ids).logits
        assert model.config._attn_implementation == "sdpa"
    handles = [_zero_slice(h[0].attn.c_proj, 2, 16), _zero_slice(h[2].attn.c_proj, 1, 16)]
    with torch.no_grad():
        want = model(ids).logits
    for x in handles:
        x.remove()
    torch.testing.assert_close(inside, want, **TOL)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_an_exception_inside_restores_the_model(minigpt):
    ids = torch.tensor([minigpt.tokenizer.encode("attention lets tokens read")])
    with torch.no_grad():
        before = minigpt(ids)[0]
    n_hooks = _hooks(minigpt)
    with pytest.raises(KeyError):
        with probe.intervene(minigpt, ids, ablate=[(0, 0)], knockout=[(-1, 0)]):
            raise KeyError("boom")
    assert _hooks(minigpt) == n_hooks
    with torch.no_grad():
        assert torch.equal(minigpt(ids)[0], before)
    with probe.intervene(minigpt, ids, ablate=[(0, 0)]):  # free again
        pass


def test_nesting_and_conflicts_are_refused(minigpt):
    ids = torch.tensor([minigpt.tokenizer.encode("attention lets tokens read")])
    with probe.intervene(minigpt, ids, ablate=[(0, 1)]):
        with pytest.raises(ProbeError, match="already installed"):
            with probe.intervene(minigpt, ids, ablate=[(1, 1)]):
                pass
        with pytest.raises(ProbeError, match="already installed"):
            probe.ablate(minigpt, ids, [(1, 1)])
        with pytest.raises(ProbeError, match="already installed"):
            probe.head_importance(minigpt, ids)
        with pytest.raises(ProbeError, match="already installed"):
            probe.knockout(minigpt.blocks[0], torch.zeros(1, 4, 64), [(-1, 0)])
    with pytest.raises(ProbeError, match="named twice"):
        with probe.intervene(minigpt, ids, ablate=[(0, 1), (0, 1)]):
            pass
    with pytest.raises(ProbeError, match="knockout="):
        with probe.intervene(minigpt, ids, knockout={"edge": [(-1, 0)]}):
            pass
    with probe.intervene(minigpt, ids, ablate=[(0, 1)]):  # nothing left installed by the refusals
        pass


def test_a_capture_inside_the_block_records_the_edited_model(minigpt):
    text = "attention lets tokens read"
    with probe.intervene(minigpt, text, ablate=[(0, 1)]):
        inside = probe.capture(minigpt, text)
    h = _zero_slice(minigpt.blocks[0].attn.proj, 1, 16)  # the same edit, written here
    try:
        want = probe.capture(minigpt, text)
    finally:
        h.remove()
    clean = probe.capture(minigpt, text)
    key = "decoder.blocks.1.self_attn.pattern"
    torch.testing.assert_close(inside[key], want[key], **TOL)
    assert (inside[key].float() - clean[key].float()).abs().max() > 1e-3
