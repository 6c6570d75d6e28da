"""Reformer's attention (issue 22, local attention): weights written as ``exp(x − logsumexp(x))``.
Local (chunked) attention mapped back to ``[query, key]``; LSH attention over hash-sorted chunks
mapped back through the positions the model sorted, its hash rounds combined as the model combines
their outputs; both stored as they are where the sequence fits one chunk.

Oracle: the model's own ``output_attentions`` (``[b, h, n, c, m·c]`` for chunked local layers,
mapped back here: column ``j`` of chunk ``i`` is key ``((i − before)·c + j) mod (n·c)``, the
chunks rolled cyclically as the model rolls them); for LSH layers, the attention's own output read
by a hook: the stored weights times the value vectors (read by a hook) must give it.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from catalogue_layouts import reformer_to_keys
from test_catalogue_structure import VOCAB, _ids, _seeded

import probe

C = 4  # chunk length


def reformer(layers, is_decoder=False, before=1, after=1):
    cfg = tf.ReformerConfig(
        vocab_size=VOCAB, hidden_size=16, num_attention_heads=2, attention_head_size=8,
        feed_forward_size=32, attn_layers=layers, local_attn_chunk_length=C, lsh_attn_chunk_length=C,
        local_num_chunks_before=before, local_num_chunks_after=after, axial_pos_embds=False,
        max_position_embeddings=64, is_decoder=is_decoder, num_buckets=2, num_hashes=1,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return _seeded(tf.ReformerModel, cfg)


def _run(model, T):
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, T - 3 :] = 0
    x = {"input_ids": _ids(2, T), "attention_mask": mask}
    with torch.no_grad(), probe.trace(model) as t:
        model(**x)
    with torch.no_grad():
        want = model(**x, output_attentions=True).attentions
    return t.cache, want


@pytest.mark.parametrize(
    "is_decoder, before, after",
    [(False, 1, 1), (True, 1, 0), (False, 2, 0)],
    ids=["both", "causal", "before2"],
)
def test_reformer_local_chunks_are_mapped_back_exactly(is_decoder, before, after):
    model = reformer(["local", "local"], is_decoder, before, after)
    c, want = _run(model, 3 * C)
    assert len(c.stacks) == 1  # one stack (its name is probe's guess: "decoder" for this model)
    stack = c.stacks[0]
    assert len(want) == 2 and want[0].dim() == 5  # chunked: [b, h, chunks, c, m·c]
    for layer, w in enumerate(want):
        got = c.pattern(stack, layer)
        torch.testing.assert_close(got, reformer_to_keys(w, before), atol=1e-6, rtol=0)
        torch.testing.assert_close(got.sum(-1), torch.ones(got.shape[:-1]), atol=1e-5, rtol=0)
        assert "Reformer's chunked local attention" in c.metadata["layers"][layer]["self_attn"]["kind"]
    got = c.pattern(stack, 0)
    if is_decoder:  # causal: nothing after the query, and the rolled-in last chunk is masked
        assert float(got.triu(1).abs().max()) == 0.0
    else:  # the first chunk reads the last one (rolled in), as the model computes it
        assert float(got[0, :, :C, 2 * C :].min()) > 0
    if before == 2:  # of 3 chunks, each reads the two before it, rolled: every key of the sequence
        assert float(got[0].min()) > 0


def test_reformer_sequence_within_one_chunk_is_plain_attention():
    model = reformer(["local", "lsh"])
    c, want = _run(model, C)
    assert want[0].shape == (2, 2, C, C) and want[1].shape == (2, 2, C, C)
    for layer in range(2):
        torch.testing.assert_close(c.pattern(c.stacks[0], layer), want[layer], atol=1e-6, rtol=0)


def _lsh_reads(model, x):
    """Each LSH layer's value vectors ``[b, h, T, d]`` and attention output (before its output
    projection) ``[b, h, T, d]``, read by hooks: the pattern must reproduce the output from the values."""
    vals, outs = [], []
    hooks = []
    for m in model.modules():
        if type(m).__name__ == "LSHSelfAttention":
            h, d = m.num_attention_heads, m.attention_head_size
            split = lambda t, h=h, d=d: t.view(*t.shape[:2], h, d).transpose(1, 2)  # noqa: E731
            hooks.append(m.value.register_forward_hook(lambda _m, _i, o, s=split: vals.append(s(o))))
            hooks.append(m.register_forward_hook(lambda _m, _i, o, s=split: outs.append(s(o.hidden_states))))
    try:
        with torch.no_grad():
            model(**x)
    finally:
        for hk in hooks:
            hk.remove()
    return vals, outs


@pytest.mark.parametrize("hashes", [1, 2])
def test_reformer_lsh_chunks_are_mapped_back_through_the_sort(hashes):
    model = reformer(["lsh", "lsh"])
    model.config.num_hashes = hashes
    for m in model.modules():
        if type(m).__name__ == "LSHSelfAttention":
            m.num_hashes = hashes
            m.hash_seed = 3  # the same buckets in every forward
    T = 4 * C
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, T - 3 :] = 0
    x = {"input_ids": _ids(2, T), "attention_mask": mask}
    with torch.no_grad(), probe.trace(model) as t:
        model(**x)
    vals, outs = _lsh_reads(model, x)
    c = t.cache
    stack = c.stacks[0]
    for layer in range(2):
        got = c.pattern(stack, layer)
        assert got.shape == (2, 2, T, T)
        # what the model reads: the weights times the values give the attention's output
        torch.testing.assert_close(got @ vals[layer], outs[layer], atol=1e-5, rtol=0)
        torch.testing.assert_close(got.sum(-1), torch.ones(got.shape[:-1]), atol=1e-5, rtol=0)
        assert float(got.diagonal(dim1=-2, dim2=-1)[0, :, 1:].max()) < 1e-6  # no query reads itself
        assert float((got == 0).float().mean()) > 0.2  # a query looks only inside its buckets
        assert "LSH attention" in c.metadata["layers"][layer]["self_attn"]["kind"]
