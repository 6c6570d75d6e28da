"""probe.capture.patterns: attention weights beside fused kernels, against a textbook oracle."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from probe.capture.patterns import sdpa_weights


def oracle(q, k, scale=None, allowed=None, bias=None):
    """softmax(q kᵀ · scale + bias) over allowed keys in float64; fully masked rows are zeros."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("...qd,...kd->...qk", q.double(), k.double()) * scale
    if bias is not None:
        s = s + bias.double()
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    w = torch.softmax(s, dim=-1)
    return torch.nan_to_num(w, nan=0.0).float()


def sdpa_out_from(w, v):
    return w @ v


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, 300, 16, generator=g) for _ in range(3)]


def test_plain_and_scale(qkv):
    q, k, v = qkv
    torch.testing.assert_close(sdpa_weights(q, k, v), oracle(q, k), atol=1e-6, rtol=0)
    torch.testing.assert_close(sdpa_weights(q, k, v, scale=0.05), oracle(q, k, 0.05), atol=1e-6, rtol=0)


def test_causal_across_chunk_boundaries(qkv):
    q, k, v = qkv
    allowed = torch.ones(300, 300, dtype=torch.bool).tril()
    for chunk in (7, 128, 512):
        w = sdpa_weights(q, k, v, is_causal=True, chunk=chunk)
        torch.testing.assert_close(w, oracle(q, k, allowed=allowed), atol=1e-6, rtol=0)
    # the weights reproduce SDPA's own output
    torch.testing.assert_close(
        w @ v, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5, rtol=0
    )


def test_causal_with_more_keys_than_queries_is_top_left_aligned():
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(1, 2, 5, 8, generator=g),
        torch.randn(1, 2, 9, 8, generator=g),
        torch.randn(1, 2, 9, 8),
    )
    allowed = torch.ones(5, 9, dtype=torch.bool).tril()
    torch.testing.assert_close(
        sdpa_weights(q, k, v, is_causal=True, chunk=2), oracle(q, k, allowed=allowed), atol=1e-6, rtol=0
    )


def test_bool_and_float_masks_broadcast_and_fully_masked_rows(qkv):
    q, k, v = qkv
    g = torch.Generator().manual_seed(2)
    allowed = torch.rand(2, 1, 300, 300, generator=g) > 0.3
    allowed[0, 0, 5] = False  # a query that may see nothing: its row is all zeros
    w = sdpa_weights(q, k, v, attn_mask=allowed, chunk=64)
    torch.testing.assert_close(w, oracle(q, k, allowed=allowed), atol=1e-6, rtol=0)
    assert torch.all(w[0, :, 5] == 0)
    keys = torch.ones(2, 1, 1, 300, dtype=torch.bool)
    keys[1, ..., 250:] = False  # padding at the end of the second text
    torch.testing.assert_close(
        sdpa_weights(q, k, v, attn_mask=keys), oracle(q, k, allowed=keys), atol=1e-6, rtol=0
    )
    bias = torch.randn(3, 300, 300, generator=g)
    bias[:, :, 100:] = float("-inf")
    torch.testing.assert_close(
        sdpa_weights(q, k, v, attn_mask=bias), oracle(q, k, bias=bias), atol=1e-6, rtol=0
    )


def test_grouped_query_heads():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, 20, 16, generator=g)
    k, v = torch.randn(1, 2, 20, 16, generator=g), torch.randn(1, 2, 20, 16, generator=g)
    w = sdpa_weights(q, k, v, is_causal=True, enable_gqa=True)
    allowed = torch.ones(20, 20, dtype=torch.bool).tril()
    torch.testing.assert_close(
        w, oracle(q, k.repeat_interleave(4, dim=1), allowed=allowed), atol=1e-6, rtol=0
    )
    torch.testing.assert_close(
        w @ v.repeat_interleave(4, dim=1),
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        atol=1e-5,
        rtol=0,
    )


def test_three_dimensional_inputs_and_half_precision():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(4, 10, 8, generator=g) for _ in range(3))
    torch.testing.assert_close(sdpa_weights(q, k, v), oracle(q, k), atol=1e-6, rtol=0)
    w = sdpa_weights(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert w.dtype == torch.float32
    torch.testing.assert_close(w, oracle(q.bfloat16().float(), k.bfloat16().float()), atol=1e-6, rtol=0)


def test_reuses_a_given_buffer(qkv):
    q, k, v = qkv
    buf = torch.empty(2, 3, 300, 300)
    w = sdpa_weights(q, k, v, is_causal=True, out=buf)
    assert w.data_ptr() == buf.data_ptr()
    wrong = torch.empty(5)
    assert sdpa_weights(q, k, v, out=wrong).shape == (2, 3, 300, 300)


@pytest.mark.parametrize("fresh", [True, False])
def test_causal_into_fresh_storage_or_a_dirty_buffer(fresh):
    # the keys a causal query never sees must come out zero, in fresh memory (uninitialised) as
    # in a reused dirty buffer
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, 700, 8, generator=g) for _ in range(3))
    out = None if fresh else torch.full((1, 4, 700, 700), float("nan"))
    w = sdpa_weights(q, k, v, is_causal=True, out=out)
    allowed = torch.ones(700, 700, dtype=torch.bool).tril()
    torch.testing.assert_close(w, oracle(q, k, allowed=allowed), atol=1e-6, rtol=0)
    assert torch.count_nonzero(w.triu(1)) == 0


def test_clean_buffer_keeps_its_zeros_and_a_mismatched_one_is_replaced(qkv):
    q, k, v = qkv
    allowed = torch.ones(300, 300, dtype=torch.bool).tril()
    buf = sdpa_weights(q, k, v, is_causal=True)  # a causal fill: zeros above the diagonal
    again = sdpa_weights(q * 2, k, v, is_causal=True, out=buf, clean=True)
    assert again.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(again, oracle(q * 2, k, allowed=allowed), atol=1e-6, rtol=0)
    # "clean" says nothing about a buffer that cannot be used: the new one is zeroed as needed
    dirty = torch.full((2, 3, 300, 299), float("nan"))
    w = sdpa_weights(q, k, v, is_causal=True, out=dirty, clean=True)
    torch.testing.assert_close(w, oracle(q, k, allowed=allowed), atol=1e-6, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
def test_row_blocks_cover_the_pattern_block_by_block(qkv, causal):
    # each block holds its rows over the keys they may see; keys after it are zero in the oracle
    q, k, v = qkv
    mask = torch.rand(2, 1, 300, 300, generator=torch.Generator().manual_seed(3)) > 0.2
    allowed = mask & torch.ones(300, 300, dtype=torch.bool).tril() if causal else mask
    want = oracle(q, k, allowed=allowed)
    from probe.capture.patterns import sdpa_blocks

    seen = []
    for start, end, block in sdpa_blocks(q, k, v, attn_mask=mask, is_causal=causal, chunk=128):
        kend = block.shape[-1]
        assert block.shape == (2, 3, end - start, kend) and block.dtype == torch.float32
        assert kend == (min(300, end) if causal else 300)
        torch.testing.assert_close(block, want[..., start:end, :kend], atol=1e-6, rtol=0)
        assert torch.count_nonzero(want[..., start:end, kend:]) == 0
        seen.append((start, end))
    assert seen == [(0, 128), (128, 256), (256, 300)]


def test_causal_blocks_take_more_rows_within_an_area(qkv):
    # under is_causal, area lets early blocks (which see few keys) take more rows: rows x kend stays
    # within the area (or one chunk of rows), and the blocks still tile the oracle's weights
    q, k, v = qkv
    want = oracle(q, k, allowed=torch.ones(300, 300, dtype=torch.bool).tril())
    from probe.capture.patterns import sdpa_blocks

    seen = []
    for start, end, block in sdpa_blocks(q, k, v, is_causal=True, chunk=16, area=4000):
        kend = block.shape[-1]
        assert kend == end and (end - start) * kend <= 4000 or end - start == 16
        torch.testing.assert_close(block, want[..., start:end, :kend], atol=1e-6, rtol=0)
        seen.append((start, end))
    assert seen[0] == (0, 63) and seen[-1][1] == 300
    assert all(a[1] == b[0] for a, b in zip(seen, seen[1:], strict=False))
    assert len(seen) < 300 // 16  # fewer blocks than a fixed chunk of rows


@pytest.mark.parametrize(
    "case", ["causal", "bool_mask", "float_mask_causal", "gqa", "broadcast_keys", "3d", "masked_row"]
)
def test_lazy_blocks_filled_part_by_part_equal_the_oracle(qkv, case):
    # lazy blocks come uncomputed; each (head, rows) part filled on its own (in any order, as the
    # row loop's threads do) gives the oracle's weights for that part, whatever the mask's shape
    from probe.capture.patterns import sdpa_blocks

    q, k, v = qkv
    g = torch.Generator().manual_seed(4)
    tril = torch.ones(300, 300, dtype=torch.bool).tril()
    kw, allowed, bias = {}, None, None
    if case == "causal":
        kw, allowed = {"is_causal": True}, tril
    elif case == "bool_mask":
        mask = torch.rand(2, 1, 300, 300, generator=g) > 0.2
        kw, allowed = {"attn_mask": mask}, mask
    elif case == "float_mask_causal":
        bias = torch.randn(1, 3, 300, 300, generator=g)
        kw, allowed = {"attn_mask": bias, "is_causal": True}, tril
    elif case == "gqa":
        k = k[:, :1]
        kw, allowed = {"is_causal": True}, tril
    elif case == "broadcast_keys":  # q and k with different batch shapes: not folded
        k = k[:1]
    elif case == "3d":
        q, k = q.reshape(6, 300, 16), k.reshape(6, 300, 16)
        kw, allowed = {"is_causal": True}, tril
    else:  # rows that may see no key at all come out as zeros
        mask = torch.rand(300, 300, generator=g) > 0.5
        mask[7] = False
        kw, allowed = {"attn_mask": mask}, mask
    want = oracle(q, k.expand(q.shape[:-2] + k.shape[-2:]) if k.shape[:-2] != q.shape[:-2] else k,
                  allowed=allowed, bias=bias)  # fmt: skip
    n = math.prod(q.shape[:-2])
    for start, end, block, fill in sdpa_blocks(q, k, v, chunk=70, lazy=True, **kw):
        block.fill_(float("nan"))  # whatever the scratch held
        r = end - start
        parts = [(bh, a, min(r, a + 25)) for bh in range(n) for a in range(0, r, 25)]
        for bh, a, b in reversed(parts):
            fill(bh, a, b)
        kend = block.shape[-1]
        torch.testing.assert_close(block, want[..., start:end, :kend], atol=1e-6, rtol=0)
