"""``retrieval_scores(model, lengths, depths)``: which heads read a needle back from far away.

After Wu et al. (2024)'s retrieval heads and the pass-key task (Mohtashami & Jaggi 2023): a
*needle* (``" The secret number of Ada is 7351."``) is planted at a chosen depth in filler text of
a chosen length, and the *question* that asks for it closes the text (``" What is the secret
number of Ada? The secret number of Ada is"``). For every self-attention head, the score is the
mass of the last query row on the needle's tokens (``needle_mass``) and on its value's tokens
(``value_mass``): a head that retrieves the fact puts its last row there. The text is built from
token ids of the pieces (each piece encoded on its own, special tokens dropped), so the needle's
span is known exactly.

The model runs through :func:`probe.forward.stream_attention`: the weights are produced a block of
query rows at a time and only the last row is read, so any length that the model runs fits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from probe import forward
from probe.analysis.table import Table
from probe.errors import ProbeError

FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = (" The secret number of Ada is", " 7351", ".")
QUESTION = " What is the secret number of Ada? The secret number of Ada is"


class _LastRow:
    """Reads the last query row's mass on ``[s, e)`` (needle) and ``[vs, ve)`` (value) per head."""

    def __init__(self, shape: tuple, spans: tuple, self_attn: bool) -> None:
        self.Q = shape[2]
        self.spans, self.self_attn = spans, self_attn
        self.mass: torch.Tensor | None = None
        self.causal = self_attn and shape[2] == shape[3]

    def rows(self, q0: int, q1: int, blk: torch.Tensor) -> None:
        if self.causal:  # judged like the statistics: no weight above the diagonal
            rows = torch.arange(q0, q1, device=blk.device)[:, None]
            above = torch.arange(blk.shape[-1], device=blk.device)[None, :] > rows
            if bool(torch.where(above, blk, 0).amax() != 0):
                self.causal = False
        if self.self_attn and q1 == self.Q:
            row = blk[:, :, self.Q - 1 - q0, :].float()
            self.mass = torch.stack([row[..., s:e].sum(-1) for s, e in self.spans], -1).cpu()  # [B, H, 2]

    def close(self) -> bool | None:
        return bool(self.causal) if self.self_attn else None


def _ids(tok: Any, text: str) -> list[int]:
    enc = tok.encode(text)
    return [i for i, s in zip(enc.ids, enc.special, strict=True) if not s]


def needle_text(tok: Any, length: int, depth: float) -> tuple[list[int], tuple[int, int], tuple[int, int]]:
    """``(ids, needle span, value span)``: ``length`` token ids of filler with the needle at
    ``depth`` (0 = the start of the filler, 1 = its end) and the question last; spans are
    ``[start, end)`` positions."""
    if not 0 <= depth <= 1:
        raise ProbeError(f"depth {depth} is not a fraction of the text; give depths between 0 and 1")
    head, value, tail = (_ids(tok, p) for p in NEEDLE)
    needle = head + value + tail
    question = _ids(tok, QUESTION)
    n = length - len(needle) - len(question)
    if n < 1:
        raise ProbeError(
            f"length {length} is too short for the needle and the question "
            f"({len(needle) + len(question)} tokens); give a longer length"
        )
    unit = _ids(tok, FILLER)
    filler = (unit * (n // len(unit) + 1))[:n]
    at = round(depth * n)
    ids = filler[:at] + needle + filler[at:] + question
    return ids, (at, at + len(needle)), (at + len(head), at + len(head) + len(value))


def retrieval_scores(
    model: nn.Module,
    lengths: list[int] = (1024,),
    depths: list[float] = (0.1, 0.5, 0.9),
    *,
    tokenizer: Any = None,
    block: int | None = None,
) -> Table:
    """Per (length, depth, layer, head): the last row's mass on the needle (see the module docs).

    ``tokenizer``: the model's (default ``model.tokenizer``). Returns a
    :class:`~probe.analysis.table.Table` with columns ``length``, ``depth``, ``needle_start``,
    ``stack``, ``layer``, ``head``, ``needle_mass`` and ``value_mass`` (self-attention heads).
    """
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ProbeError("retrieval_scores builds text: pass tokenizer= (or give the model a .tokenizer)")
    tok = forward.adapt_tokenizer(tokenizer)
    rows = []
    for length in lengths:
        for depth in depths:
            ids, needle, value = needle_text(tok, int(length), float(depth))
            x = torch.tensor([ids], device=next(model.parameters()).device)

            def open_attention(meta, role, shape, spans=(needle, value)):
                return _LastRow(shape, spans, role == "self")

            _, readers = forward.stream_attention(model, x, open_attention, block=block)
            for key in sorted(readers, key=_order):
                r = readers[key]
                if r.mass is None:
                    continue
                stack, rest = key.split(".blocks.", 1)
                layer = int(rest.split(".")[0])
                for h in range(r.mass.shape[1]):
                    rows.append(
                        {
                            "length": len(ids),
                            "depth": float(depth),
                            "needle_start": needle[0],
                            "stack": stack,
                            "layer": layer,
                            "head": h,
                            "needle_mass": float(r.mass[0, h, 0]),
                            "value_mass": float(r.mass[0, h, 1]),
                        }
                    )
    columns = ["length", "depth", "needle_start", "stack", "layer", "head", "needle_mass", "value_mass"]
    return Table(rows, columns, title="retrieval scores (last row's mass on the needle)")


def _order(key: str) -> tuple:
    parts = key.split(".")
    return (parts[0], int(parts[2]), parts[3])


__all__ = ["retrieval_scores", "needle_text", "FILLER", "NEEDLE", "QUESTION"]
