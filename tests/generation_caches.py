"""Generation caches built per the generation contract, for the analysis, report and CLI tests.

A full-pattern generation cache is exactly a ``probe.capture`` of the sequence the model read
(prompt + output[:-1]) with ``metadata["generation"]`` and the positions' kinds added (see
/work/notes/generation_contract.md, docs/generation.md). Greedy decoding is done here, with the
model's own forward; the oracle weights come from the model's own attention code (minigpt's heads
return their weights), never from probe.
"""

from __future__ import annotations

import copy

import torch

import probe

PROMPT = "attention lets"
NEW = 12  # minigpt's context holds 32 positions: 14 + 12 - 1 fit


def greedy(model, ids: list[int], n: int) -> list[int]:
    """``n`` tokens after ``ids`` by argmax of minigpt's logits (its own forward)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(torch.tensor([seq]))
            seq.append(int(logits[0, -1].argmax()))
    return seq[len(ids) :]


def as_generation(
    cache, prompt_len: int, new_ids: list[int], *, text=None, prompt_text=None, stack="decoder"
):
    """``cache`` (a capture of prompt + output[:-1]) as the contract's generation cache."""
    meta = copy.deepcopy(dict(cache.metadata))
    length = prompt_len + len(new_ids) - 1
    meta["generation"] = {
        "prompt_length": prompt_len,
        "new_tokens": len(new_ids),
        "output_ids": list(new_ids),
        "output_text": text,
        "prompt_text": prompt_text,
        "last_token_read": False,
        "strategy": "greedy",
        "stack": stack,
    }
    stacks = meta.setdefault("stacks", {})
    entry = stacks.setdefault(stack, {})
    pos = dict(entry.get("positions") or {})
    kinds = pos.get("kinds") or ["prompt"] * prompt_len
    pos["kinds"] = list(kinds[:prompt_len]) + ["generated"] * (length - prompt_len)
    entry["positions"] = pos
    return probe.Cache({k: cache[k] for k in cache.keys()}, meta)


def minigpt_generation(model, keep=None, prompt: str = PROMPT, n: int = NEW):
    """(generation cache, prompt ids, new ids) of minigpt's greedy continuation of ``prompt``."""
    tok = model.tokenizer
    ids = tok.encode(prompt)
    new = greedy(model, ids, n)
    read = torch.tensor([ids + new[:-1]])
    cache = probe.capture(model, read, keep=keep)
    gen = as_generation(cache, len(ids), new, text=tok.decode(new), prompt_text=prompt)
    return gen, ids, new


def minigpt_weights(model, ids: list[int]) -> list[torch.Tensor]:
    """Every layer's weights ``[head, T, T]`` (float64) as minigpt's own heads return them."""
    x = torch.tensor([ids])
    out = []
    with torch.no_grad():
        h = model.token_embedding_table(x) + model.position_embedding_table(torch.arange(x.shape[1]))
        for block in model.blocks:
            _, w = block.attn(block.ln1(h), return_weights=True)
            out.append(w[0].double())
            h = block(h)
    return out


def aligner_generation(model, source: str = "gestern sah der junge das hundehaus"):
    """(generation cache, decoder ids read) of the aligner's greedy translation: the decoder's
    prompt is its start token; probe.capture decodes greedily when given no target."""
    cache = probe.capture(model, source)
    read = cache.metadata["target_ids"][0]
    eos = model.tokenizer.eos_id
    new = read[1:] + [eos]
    words = cache.metadata["target_tokens"][0][1:] + ["E"]
    gen = as_generation(cache, 1, new, text=" ".join(words), prompt_text=source)
    gen.metadata["generation"]["output_tokens"] = words
    return gen, read


def llava_pair():
    """A LLaVA-shaped model (CLIP tower: 4 x 4 patches of 8 pixels + [CLS]; Llama language model
    with GQA; random weights) on SDPA, its eager twin with the same weights, and inputs: a text of
    21 ids whose positions 2..17 are the picture's 16 image tokens (id 95), and 32 x 32 pixels."""
    import transformers as tf

    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    vision = tf.CLIPVisionConfig(**small, image_size=32, patch_size=8)
    text = tf.LlamaConfig(**small, vocab_size=96, num_key_value_heads=2, max_position_embeddings=128)
    cfg = tf.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=95, vision_feature_layer=-1
    )
    torch.manual_seed(0)
    model = tf.LlavaForConditionalGeneration._from_config(cfg).eval()
    eager = tf.LlavaForConditionalGeneration._from_config(copy.deepcopy(cfg), attn_implementation="eager")
    eager.eval().load_state_dict(model.state_dict())
    ids = torch.tensor([[1, 5] + [95] * 16 + [7, 8, 9]])
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    return model, eager, {"input_ids": ids, "pixel_values": pixels, "attention_mask": torch.ones_like(ids)}
