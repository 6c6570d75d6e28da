"""Reformer's attention (issue 22, local attention): weights written as ``exp(x − logsumexp(x))``.
Local (chunked) attention mapped back to ``[query, key]``, exact; LSH attention over hash-sorted
chunks refused naming its layers, and stored as it is where the sequence fits one chunk.

Oracle: the model's own ``output_attentions`` (``[b, h, n, c, m·c]`` for chunked local layers,
mapped back here: column ``j`` of chunk ``i`` is key ``((i − before)·c + j) mod (n·c)``, the
chunks rolled cyclically as the model rolls them).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from catalogue_layouts import reformer_to_keys
from test_catalogue_structure import VOCAB, _ids, _seeded

import probe
from probe.errors import ProbeError

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


def test_reformer_chunked_lsh_attention_is_refused_naming_its_layers():
    model = reformer(["local", "lsh", "local"])
    with pytest.raises(ProbeError, match=r"^reformer: layers encoder\.layers\.1 compute attention") as e:
        _run(model, 3 * C)
    assert "Reformer's LSH attention over hash-sorted chunks is not mapped back" in str(e.value)
