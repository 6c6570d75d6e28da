"""Focus statistics while the model runs: every metric from row blocks, no pattern ever whole.

``probe.head_stats(model, inputs)`` runs one forward through :func:`probe.forward.stream_attention`,
which hands each attention's weights a block of query rows at a time (recomputed SDPA weights, or
slices of a softmax the model computed) to a :class:`RowTerms` made here. It turns each block into
the per-query :class:`~probe.analysis.focus.metrics.Terms` of its rows and drops it; when the
forward is done, :func:`~probe.analysis.focus.metrics.reduce` turns the terms into the metrics,
exactly as for a captured cache. Peak memory is one block (``[batch, heads, rows, keys]``) plus
O(batch · heads · T) of terms per layer, never a ``T × T`` pattern.

Whether a self-attention layer is causal (which decides the counted queries) is judged on every
block as it passes: no weight above the diagonal between real tokens. Attention rollout needs every
layer's whole pattern, so it is not computed on this path (``HeadStats.not_computed`` says so).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from probe.analysis.focus.metrics import LOCAL_WINDOW, Layout, Terms, reduce, word_masses
from probe.analysis.focus.reach import distance_terms
from probe.analysis.focus.result import HeadStats
from probe.analysis.focus.running import RunningStats
from probe.analysis.focus.tokens import Side, side
from probe.cache.format import parse_key
from probe.errors import ProbeError

ROLLOUT_NOTE = (
    "attention rollout multiplies every layer's whole T x T pattern; head_stats(model, ...) never "
    "holds one: capture the model (probe.capture) and pass the cache to compute it"
)


class RowTerms:
    """The :class:`Terms` of one attention ``[B, H, Q, K]``, filled by :meth:`rows` a block of
    query rows at a time; :meth:`close` says whether it was causal, :meth:`values` gives the
    metrics ``[B, H, M]``."""

    def __init__(self, qs: Side, ks: Side, shape: tuple[int, ...], *, self_attn: bool) -> None:
        B, H, Q, K = shape
        self.shape, self.self_attn, self.qs, self.ks = shape, self_attn, qs, ks
        self.lay = Layout(qs, ks, Q, K, causal=False)
        self.causal = self_attn and Q == K and Q >= 2
        self.words = self_attn and self.lay.words_split
        self.ids = self_attn and qs.ids is not None and ks.ids is not None

        def new():
            return torch.zeros(B, H, Q)

        t = Terms(
            new(), new(), torch.zeros(B, H, Q, dtype=torch.long), new(), new(), torch.zeros(B, H, Q, 3), new()
        )
        if self_attn:
            t.diag = {d: new() for d in range(-LOCAL_WINDOW, LOCAL_WINDOW + 1)}
            t.key_sum, t.dist = new(), new()
            t.word = {n: new() for n in ("word_prev", "word_self", "word_next")} if self.words else None
            if self.ids:
                t.tmpl = {n: new() for n in ("prev", "dup", "induction")}
                t.hits = {n: torch.zeros(B, Q, dtype=torch.bool) for n in ("dup", "induction")}
        self.t = t
        self.recv = torch.zeros(B, H, K, dtype=torch.float64)  # Σ over real queries of a_ij
        self.recv_first = torch.zeros(B, H, K, dtype=torch.float64)  # the first real query's row
        self._dev: dict[str, dict[str, torch.Tensor]] = {}

    def _on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The key-side facts on ``device`` (copied once per device)."""
        d = self._dev.get(str(device))
        if d is None:
            ks, lay = self.ks, self.lay
            d = {
                "real": ks.real.to(device),
                "cols": lay.masks[:, 0].permute(0, 2, 1).contiguous().to(device),  # [B, 3, K]
                "kf": lay.kj.float().to(device),
                "first": ks.first.to(device),
            }
            self._dev[str(device)] = d
        return d

    def rows(self, q0: int, q1: int, blk: torch.Tensor) -> None:
        """Fold in the weights ``blk`` ``[B, H, q1 - q0, kend]`` of query rows ``q0:q1``."""
        B, H, r, kend = blk.shape
        dev = self._on(blk.device)
        P = blk.float()
        if self.lay.any_pad:  # weight on padding keys is not attention to the text
            P = torch.where(dev["real"][:, None, None, :kend], P, 0)
        rows = torch.arange(q0, q1, device=blk.device)
        kj = torch.arange(kend, device=blk.device)
        if self.causal:
            above = (kj[None, :] > rows[:, None]) & self.qs.real[:, q0:q1, None].to(blk.device)
            above = above & dev["real"][:, None, :kend]
            if bool(torch.where(above[:, None], P, 0).amax() != 0):
                self.causal = False
        t, sl = self.t, slice(q0, q1)
        tiny = torch.finfo(P.dtype).tiny
        t.ent[..., sl] = (P.clamp_min(tiny).log_().mul_(P)).sum(-1).neg_().cpu()
        t.total[..., sl] = P.sum(-1).cpu()
        self._sorted(P, sl, kend)
        cols = dev["cols"][..., :kend]
        t.masks[:, :, sl] = torch.einsum("bhrk,bck->bhrc", P, cols).cpu()
        first = dev["first"].clamp(max=kend - 1)[:, None, None, None].expand(B, H, r, 1)
        got = P.gather(-1, first)[..., 0]
        t.first[..., sl] = torch.where((dev["first"] < kend)[:, None, None], got, 0).cpu()
        w = self.qs.real[:, q0:q1].to(P)
        self.recv[..., :kend] += torch.einsum("bhrk,br->bhk", P, w).double().cpu()
        for b, f in enumerate(self.qs.first.tolist()):
            if q0 <= f < q1:
                self.recv_first[b, :, :kend] = P[b, :, f - q0].double().cpu()
        if self.self_attn:
            self._self_rows(P, rows, kj, sl)

    def _sorted(self, P: torch.Tensor, sl: slice, kend: int) -> None:
        """Max, first argmax and the effective span of each row (sorted once)."""
        t = self.t
        if P.device.type == "cpu":
            a = P.numpy()
            t.arg[..., sl] = torch.from_numpy(a.argmax(-1))
            vals = torch.from_numpy(np.sort(a, -1))
        else:
            t.arg[..., sl] = P.argmax(-1).cpu()
            vals = P.sort(-1).values
        t.top[..., sl] = vals[..., -1].cpu()
        torch.cumsum(vals, -1, out=vals)
        rest = (1 - 0.9) * vals[..., -1:]
        left = torch.searchsorted(vals, rest.contiguous(), side="right")[..., 0]
        t.span[..., sl] = (kend - left).float().cpu()

    def _self_rows(self, P: torch.Tensor, rows: torch.Tensor, kj: torch.Tensor, sl: slice) -> None:
        t, r, kend = self.t, P.shape[-2], P.shape[-1]
        t.key_sum[..., sl] = (P @ self._on(P.device)["kf"][:kend]).cpu()
        ri = torch.arange(r, device=P.device)
        for d, out in t.diag.items():
            idx = rows + d
            ok = (idx >= 0) & (idx < kend)
            out[..., sl] = torch.where(ok, P[..., ri, idx.clamp(0, kend - 1)], 0).cpu()
        t.dist[..., sl] = (P * (kj[None, :] - rows[:, None]).abs().float()).sum(-1).cpu()
        beyond, reach = distance_terms(P, rows, self.shape[3])
        for D, v in beyond.items():
            t.beyond.setdefault(D, torch.zeros(t.ent.shape))[..., sl] = v.cpu()
        if t.reach is None:
            t.reach = torch.zeros(t.ent.shape)
        t.reach[..., sl] = reach.cpu()
        if t.word is not None:
            masses = word_masses(P.cumsum(-1), self.lay, rows.cpu())
            for n, m in masses.items():
                t.word[n][..., sl] = m.cpu()
        if t.tmpl is not None:
            for n, D in _templates(self.qs, self.ks, rows.cpu()).items():
                D = D.to(P.device)
                t.tmpl[n][..., sl] = (P * D[:, None, :, :kend]).sum(-1).cpu()
                if n in t.hits:
                    t.hits[n][:, sl] = D.any(-1).cpu()

    def close(self) -> bool | None:
        """Whether this self-attention was causal (None for cross-attention)."""
        return bool(self.causal) if self.self_attn else None

    def layout(self) -> Layout:
        _, _, Q, K = self.shape
        return Layout(self.qs, self.ks, Q, K, causal=True) if self.causal else self.lay

    def values(self) -> torch.Tensor:
        """Every metric per text and head, ``[B, H, M]``."""
        return reduce(self.t, self.layout(), self_attn=self.self_attn)

    def received(self) -> torch.Tensor:
        """The sink profile ``[B, H, K]`` (float64): each key's mean weight over the counted
        queries (the first real query of a causal layer is not counted)."""
        lay = self.layout()
        s = self.recv - self.recv_first if self.causal else self.recv
        n = lay.counted[:, 0].sum(-1).double()[:, None, None]
        return torch.where(n > 0, s / n.clamp(min=1), float("nan"))


def _templates(qs: Side, ks: Side, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """The template masks ``D`` ``[B, r, K]`` of the query rows ``rows`` (see the module docs of
    :mod:`probe.analysis.focus`): previous token, duplicate token, induction."""
    K = ks.real.shape[1]
    qi, kj = rows[:, None], torch.arange(K)[None, :]
    real = qs.real[:, rows, None] & ks.real[:, None, :]
    same = (qs.ids[:, rows, None] == ks.ids[:, None, :]) & real
    prev_same = torch.zeros_like(same)
    prev_same[:, :, 1:] = same[:, :, :-1] & ks.real[:, None, 1:]
    return {"prev": real & (kj == qi - 1), "dup": same & (kj < qi), "induction": prev_same & (kj <= qi)}


class _Candidates:
    """One attention read for each stack it may belong to (an encoder-decoder's self-attention
    where source and target have the same shape); the stack is known once the forward is named."""

    def __init__(self, readers: dict[str, RowTerms]) -> None:
        self.readers = readers

    def rows(self, q0: int, q1: int, blk: torch.Tensor) -> None:
        for r in self.readers.values():
            r.rows(q0, q1, blk)

    def close(self) -> bool | None:
        return next(iter(self.readers.values())).close()

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
            out[st] = RowTerms(qs, ks, shape, self_attn=role == "self")
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
) -> HeadStats:
    """Focus statistics of every head of ``model`` on ``inputs`` from one forward, block by block
    (see the module docstring); the same :class:`HeadStats` as ``head_stats(capture(...))``, less
    the rollout (``not_computed["rollout"]`` gives the reason)."""
    from probe.forward import stream_attention

    meta, readers = stream_attention(
        model, inputs, stats_readers(), tokenizer=tokenizer, target=target, layers=layers, block=block
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
        values = terms.values()
        name = f"{stack}/{layer}/{kind}"
        acc.stats[name] = RunningStats().update(values)
        acc.heads[name] = list(range(values.shape[1]))
        acc.causal[name] = bool(terms.causal)
        acc.received[name] = terms.received()
        batch = values.shape[0]
    acc.n_texts = batch
    acc.not_computed = {"rollout": ROLLOUT_NOTE}
    return acc


__all__ = ["RowTerms", "model_head_stats", "stats_readers", "accumulate", "ROLLOUT_NOTE"]
