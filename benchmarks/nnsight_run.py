"""nnsight saving every layer's attention weights of an eager Hugging Face GPT-2 (a benchmark peer).

nnsight compiles the body of its ``with model.trace(...)`` block from source, so the block lives
in a file of its own.
"""

from __future__ import annotations


def saved_attention(nm, ids) -> list:
    """Run ``nm`` (an ``nnsight.NNsight`` over an eager GPT2LMHeadModel) once; return the
    attention weights ``[batch, head, query, key]`` of every layer."""
    saved = []
    with nm.trace(ids):
        for block in nm.transformer.h:
            saved.append(block.attn.output[1].save())
    return [s.value if hasattr(s, "value") else s for s in saved]
