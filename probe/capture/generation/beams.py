"""Beam search: the returned beam followed through the steps, as it was reordered in the KV cache.

A beam search runs every step on ``num_beams`` rows at once and reorders the KV cache between
steps (each surviving beam takes the cache row of the beam it extends). Each step's query row of
batch row ``j`` reads beam ``j``'s own history, so the row that wrote token ``t`` of the returned
sequence is step ``t``'s row of the batch row that token came from: ``generate``'s
``beam_indices[t]`` (``return_dict_in_generate=True``). :func:`follow` keeps those rows of the
generating stack (the prompt's rows, read alike by every beam, from row 0), cropped to the
sequence returned (a beam that finished early is shorter than the steps run). Stacks read once
(an encoder, batch 1) are left as they are.
"""

from __future__ import annotations

import torch
from torch import Tensor

from probe.cache.format import parse_key, parse_name
from probe.errors import ProbeError


def beam_of_rows(beam_indices: Tensor, prompt: int) -> Tensor:
    """The batch row of every position read, ``[P - 1 + N]``: 0 for the prompt's rows, then the beam
    each returned token came from (``beam_indices[0]``, -1 past the end of the returned sequence)."""
    idx = beam_indices[0].long().cpu()
    idx = idx[idx >= 0]
    return torch.cat([torch.zeros(prompt - 1, dtype=torch.long), idx])


def follow(tensors: dict[str, Tensor], stack: str, rows: Tensor, beams: int) -> dict[str, Tensor]:
    """``tensors`` with the generating ``stack``'s batch of ``beams`` rows reduced to the returned
    beam (batch 1), position by position as :func:`beam_of_rows` gives (see the module docstring)."""
    T = rows.numel()
    pos = torch.arange(T)
    out = dict(tensors)
    for k, t in tensors.items():
        st, _, name = parse_key(k)
        if st != stack:
            continue
        if t.size(0) != beams:
            raise ProbeError(f"beam search: {k} holds {t.size(0)} rows, not one per beam ({beams})")
        field = parse_name(name).field
        b = rows.to(t.device)
        p = pos.to(t.device)
        if field is None:  # [beams, positions, d]
            out[k] = t[b, p][None]
        elif field in ("pattern", "topk_values", "topk_indices"):  # [beams, heads, positions, ...]
            w = t[b, :, p].transpose(0, 1)[None]
            out[k] = w[..., :T] if field == "pattern" and ".self_attn" in k else w
        elif field == "topk_mass":
            out[k] = t[b, :, p].transpose(0, 1)[None]
        elif field == "rows":
            index = tensors[k.removesuffix(".rows") + ".row_index"][0].long()
            keep = [j for j, r in enumerate(index.tolist()) if r < T]
            sel = t[rows[index[keep]].to(t.device), :, torch.tensor(keep, device=t.device)]
            width = T if ".self_attn" in k else t.size(-1)
            out[k] = sel.transpose(0, 1)[None][..., :width].contiguous()
            out[k.removesuffix(".rows") + ".row_index"] = index[keep][None]
        elif field != "row_index":
            raise ProbeError(f"beam search: probe cannot follow the beam through {name}")
    return {k: v.contiguous() for k, v in out.items()}


__all__ = ["beam_of_rows", "follow"]
