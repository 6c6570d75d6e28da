"""One streamed run of the focus statistics: a reader per attention, the forward, the readers folded.

:func:`stats_readers` makes the factory that ``probe.forward.stream_attention`` (and a capture's
``keep="stats"``) asks for one reader per attention: a
:class:`~probe.analysis.focus.streamed.reader.RowTerms` per stack the attention may belong to
(:class:`_Candidates`: an encoder-decoder's self-attention whose source and target have the same
shape is read for both until the forward is named). :func:`run_model` runs the forward;
:func:`fold_readers` folds its readers into a
:class:`~probe.analysis.focus.accumulator.FocusAccumulator` (``probe.head_stats(model, ...)``).
"""

from __future__ import annotations

from typing import Any

import torch

from probe.analysis.focus.backends.workspace import Workspace
from probe.analysis.focus.definitions.tokens import Side, side
from probe.analysis.focus.streamed.notes import streamed_not_computed
from probe.analysis.focus.streamed.reader import RowTerms, one_thread
from probe.cache.format import parse_key
from probe.errors import ProbeError


class _Candidates:
    """One attention read for each stack it may belong to (an encoder-decoder's self-attention
    where source and target have the same shape); the stack is known once the forward is named."""

    def __init__(self, readers: dict[str, RowTerms]) -> None:
        self.readers = readers

    def sdpa_call(self, args: tuple, kwargs: dict) -> bool:
        return len(self.readers) == 1 and next(iter(self.readers.values())).sdpa_call(args, kwargs)

    def reading(self):
        return next(iter(self.readers.values())).reading()

    def fills(self, device: torch.device) -> bool:
        return len(self.readers) == 1 and next(iter(self.readers.values())).fills(device)

    def recomputed(self) -> None:
        for r in self.readers.values():
            r.recomputed()

    def rows(self, q0: int, q1: int, blk: torch.Tensor, fill: Any = None) -> None:
        for r in self.readers.values():
            r.rows(q0, q1, blk, fill)

    def close(self) -> bool | None:
        return [r.close() for r in self.readers.values()][0]  # each settles its own terms

    def of(self, stack: str) -> RowTerms:
        r = self.readers.get(stack) or self.readers.get("*")
        if r is None:
            raise ProbeError(f"internal: no statistics read for the {stack} stack")
        return r


def stats_readers():
    """``open_attention(meta, role, [B, H, Q, K]) -> reader``: a fresh factory of the readers that
    compute the focus statistics (one :class:`RowTerms` per stack the attention may belong to;
    ``reader.of(stack)`` is it). What a capture-side consumer of row blocks (``BlockConsumer``, a
    future ``keep=\"stats\"``) is handed to build :class:`HeadStats` without holding patterns."""
    sides: dict[tuple, Side] = {}
    ws = Workspace()

    def side_of(meta, stack, role, B, L):
        k = (stack, role, B, L)
        if k not in sides:
            sides[k] = side(meta, stack, role, B, L)
        return sides[k]

    def open_attention(meta: dict, role: str, shape: tuple) -> _Candidates:
        B, H, Q, K = shape
        enc_dec = meta.get("target_tokens") is not None
        stacks = ("*",) if not enc_dec else ("decoder",) if role == "cross" else ("encoder", "decoder")
        out, err = {}, None
        for st in stacks:
            name = "decoder" if st == "*" else st
            try:
                qs = side_of(meta, name, "own", B, Q)
                ks = side_of(meta, name, "own" if role == "self" else "source", B, K)
            except ProbeError as e:
                err = e
                continue
            out[st] = RowTerms(qs, ks, shape, self_attn=role == "self", ws=ws)
        if not out:
            raise err
        return _Candidates(out)

    return open_attention


def run_model(
    model: Any,
    inputs: Any,
    *,
    tokenizer: Any = None,
    target: Any = None,
    layers: list[int] | None = None,
    block: int | None = None,
    progress: bool = False,
    **pictures_or_sound: Any,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One forward of ``model`` on ``inputs`` with :func:`stats_readers`' readers, block by block:
    ``(metadata, readers)``, each reader under its pattern's cache key (:func:`fold_readers`)."""
    from probe.forward import stream_attention

    return stream_attention(
        model,
        inputs,
        stats_readers(),
        tokenizer=tokenizer,
        target=target,
        layers=layers,
        block=block,
        progress=progress,
        **pictures_or_sound,  # processor=, text=, sampling_rate= as for probe.capture
    )


def fold_readers(acc: Any, meta: dict[str, Any], readers: dict[str, Any]) -> None:
    """Fold one forward's readers (:func:`run_model`'s) into ``acc``, a fresh
    :class:`~probe.analysis.focus.accumulator.FocusAccumulator`: per attention its per-text
    metrics and sink profile, the rollout left out (:func:`~.notes.streamed_not_computed`)."""
    order = {s: i for i, s in enumerate(meta.get("stacks", {}))}
    keyed = []
    for key, reader in readers.items():
        stack, layer, what = parse_key(key)
        kind = what.split("_attn")[0]
        keyed.append(
            ((order.get(stack, 99), layer, 0 if kind == "self" else 1), (stack, layer, kind), reader)
        )
    acc.note_model(meta)
    received, batch = {}, 0
    for _, (stack, layer, kind), cands in sorted(keyed, key=lambda x: x[0]):
        terms = cands.of(stack)
        with one_thread():  # [B, H, Q] terms: torch's thread team only waits at each small op
            values = terms.values()
            recv = terms.received()
        name = f"{stack}/{layer}/{kind}"
        acc.fold(name, values, list(range(values.shape[1])), bool(terms.causal))
        received[name] = recv
        batch = values.shape[0]
    acc.add_texts(batch, received=received)
    acc.leave_out(streamed_not_computed(meta))


__all__ = ["stats_readers", "run_model", "fold_readers"]
