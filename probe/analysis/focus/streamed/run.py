"""One streamed run of the focus statistics: a reader per attention, the forward, the table.

:func:`stats_readers` makes the factory that ``probe.forward.stream_attention`` (and a capture's
``keep="stats"``) asks for one reader per attention: a :class:`~probe.analysis.focus.streamed.reader.RowTerms`
per stack the attention may belong to (:class:`_Candidates`: an encoder-decoder's self-attention
whose source and target have the same shape is read for both until the forward is named).
:func:`model_head_stats` runs the forward; :func:`accumulate` turns the readers into the
:class:`~probe.analysis.focus.result.HeadStats` table.
"""

from __future__ import annotations

from typing import Any

import torch

from probe.analysis.focus.backends import reference as rb
from probe.analysis.focus.definitions.running import RunningStats
from probe.analysis.focus.definitions.tokens import Side, side
from probe.analysis.focus.result import HeadStats
from probe.analysis.focus.streamed.reader import RowTerms, one_thread, streamed_not_computed
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
    ws = rb.Workspace()

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


def model_head_stats(
    model: Any,
    inputs: Any,
    *,
    tokenizer: Any = None,
    target: Any = None,
    layers: list[int] | None = None,
    block: int | None = None,
    progress: bool = False,
    **pictures_or_sound: Any,
) -> HeadStats:
    """Focus statistics of every head of ``model`` on ``inputs`` from one forward, block by block
    (see the module docstring); the same :class:`HeadStats` as ``head_stats(capture(...))``, less
    the rollout (``not_computed["rollout"]`` gives the reason)."""
    from probe.forward import stream_attention

    meta, readers = stream_attention(
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
    return accumulate(meta, readers).result()


def accumulate(meta: dict[str, Any], readers: dict[str, Any]):
    """The :class:`~probe.analysis.focus.stats.FocusAccumulator` of one forward's readers
    (:func:`stats_readers`'s, each under its pattern's cache key) and the capture's metadata;
    ``.result()`` is the :class:`HeadStats`."""
    from probe.analysis.focus.stats import FocusAccumulator, _kv_group

    order = {s: i for i, s in enumerate(meta.get("stacks", {}))}
    keyed = []
    for key, reader in readers.items():
        stack, layer, what = parse_key(key)
        kind = what.split("_attn")[0]
        keyed.append(
            ((order.get(stack, 99), layer, 0 if kind == "self" else 1), (stack, layer, kind), reader)
        )
    acc = FocusAccumulator()
    acc.kv_group = _kv_group(meta)
    acc.received = {}
    batch = 0
    for _, (stack, layer, kind), cands in sorted(keyed, key=lambda x: x[0]):
        terms = cands.of(stack)
        with one_thread():  # [B, H, Q] terms: torch's thread team only waits at each small op
            values = terms.values()
            received = terms.received()
        name = f"{stack}/{layer}/{kind}"
        acc.stats[name] = RunningStats().update(values)
        acc.heads[name] = list(range(values.shape[1]))
        acc.causal[name] = bool(terms.causal)
        acc.received[name] = received
        batch = values.shape[0]
    acc.n_texts = batch
    acc.not_computed = streamed_not_computed(meta)
    return acc


__all__ = ["stats_readers", "model_head_stats", "accumulate"]
