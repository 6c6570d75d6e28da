"""MLP ablation in post-norm layers (``norm(x + mlp(x))``): BERT (all-MiniLM-L6-v2, a padded
batch) and BART (encoder and decoder), against a forward hook written here on the module whose
output the model adds to the residual (BertOutput.dense, BART's fc2), float32, to 1e-6."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import hf_fixtures as hf  # noqa: E402

import probe  # noqa: E402

TOL = dict(rtol=0, atol=1e-6)


def _replaced(run, modules, value=torch.zeros_like):
    """``run()`` with each module's output replaced by ``value(output)``."""
    handles = [m.register_forward_hook(lambda mod, a, out: value(out)) for m in modules]
    with torch.no_grad():
        out = run()  # each test builds its own model: a hook left by a failure goes with it
    for h in handles:
        h.remove()
    return out


def test_minilm_mlp_zero_and_mean_with_padding():
    model, tok, _ = hf.minilm()
    texts = ["attention lets tokens read context.", "graph networks"]
    enc = tok(texts, return_tensors="pt", padding=True)
    dense = [model.encoder.layer[i].output.dense for i in (1, 4)]
    r = probe.ablate(model, texts, sublayers=[(1, "mlp"), (4, "mlp")], tokenizer=tok)
    want = _replaced(lambda: model(**enc), dense)
    torch.testing.assert_close(r.outputs.last_hidden_state, want.last_hidden_state, **TOL)
    assert r.table.column("module") == ["encoder.layer.1.output.dense", "encoder.layer.4.output.dense"]
    assert r.summary["max_abs_change"] > 1e-2
    # mean: the MLP output's mean over the real tokens of the inputs, recorded by a hook here
    got = {}
    h = dense[0].register_forward_hook(lambda mod, a, out: got.setdefault("y", out.detach().clone()))
    with torch.no_grad():
        model(**enc)
    h.remove()
    mean = got["y"][enc["attention_mask"].bool()].mean(0)
    r = probe.ablate(model, texts, sublayers=[(1, "mlp")], tokenizer=tok, how="mean")
    want = _replaced(lambda: model(**enc), dense[:1], lambda out: mean.expand_as(out))
    torch.testing.assert_close(r.outputs.last_hidden_state, want.last_hidden_state, **TOL)


def test_bart_encoder_and_decoder_mlp():
    model = hf.bart(100)
    src = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(3))
    tgt = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(4))
    inputs = {"input_ids": src, "decoder_input_ids": tgt, "use_cache": False}
    r = probe.ablate(model, inputs, sublayers=[("encoder", 0, "mlp"), ("decoder", 2, "mlp")])
    m = model.model
    want = _replaced(lambda: model(**inputs), [m.encoder.layers[0].fc2, m.decoder.layers[2].fc2])
    torch.testing.assert_close(r.outputs.logits, want.logits, **TOL)
    assert r.summary["max_abs_change"] > 1e-3
    with probe.intervene(model, inputs, sublayers=[("decoder", 1, "mlp")]), torch.no_grad():
        inside = model(**inputs).logits
    want = _replaced(lambda: model(**inputs), [m.decoder.layers[1].fc2])
    torch.testing.assert_close(inside, want.logits, **TOL)
