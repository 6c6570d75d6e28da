"""Causal checks that run the model (through :mod:`probe.forward` only) and catch leaks anywhere.

:class:`Functional` holds one input, the tolerances and what the checks found; here are checks (a)
suffix perturbation and (b) input gradient (does the past depend on the future?), in
:mod:`.parity` checks (c)-(e) (does the same forward computed another way agree?).

Cost on a clean model (the usual case), besides the capture that feeds the static checks:

=========================  =============================================================
suffix perturbation        1 forward (a batch: the text + 2 random suffixes at 4 cut points)
gradient                   1 forward + 1 backward (a batch of 4 cut points)
padding (left and right)   1 forward (a batch of 3), where the model takes a padding mask
KV cache                   3 forwards (prefix, a chunk, one token), where the model has one
backend parity             1 forward on a copy of the model, where it offers eager and SDPA
=========================  =============================================================

A failing check spends one or two more captures to localise the leak (layer, head, positions).
"""

from __future__ import annotations

from typing import Any

import torch

from probe import forward
from probe.analysis.causal.report import Finding
from probe.errors import ProbeError

N_REPLACEMENTS = 2


def relative_change(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (0 for empty slices)."""
    if a.numel() == 0:
        return 0.0
    a, b = a.float(), b.float()
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb):
        return float("inf")  # NaN/inf in one run and not the other
    if not bool(fa.any()):
        return 0.0
    scale = float(b[fb].abs().max()) or 1.0
    return float((a[fa] - b[fb]).abs().max()) / scale


def _nonfinite(out: torch.Tensor, cuts: list[int]) -> str | None:
    """Why outputs ``out`` (the text, then one perturbed copy per cut in ``cuts``) cannot be
    compared: NaN/inf in the text's outputs or at the compared positions of a copy; None if finite.
    A NaN also reaches earlier positions through a zero weight (0 x NaN is NaN), so a copy whose
    random suffix holds a token with NaN weights is no evidence of a leak."""
    if not bool(torch.isfinite(out[0]).all()):
        return "the model's outputs are NaN/inf on the text itself (NaN/inf weights, or a fully masked row)"
    bad = sum(not bool(torch.isfinite(out[i + 1, : t + 1]).all()) for i, t in enumerate(cuts))
    if bad:
        return (
            f"the model's outputs are NaN/inf on {bad} of {len(cuts)} copies of the text "
            "with a random suffix (NaN/inf weights for some tokens?)"
        )
    return None


def cut_points(T: int) -> list[int]:
    """The positions t after which suffixes are replaced: about T/4, T/2, 3T/4 and T-2."""
    return sorted({t for t in (T // 4, T // 2, (3 * T) // 4, T - 2) if 0 <= t <= T - 2})


class Functional:
    """The functional checks on one input ``x`` [1, T] (ids or float inputs) of a causal stack."""

    def __init__(
        self,
        model,
        x,
        *,
        tol,
        vocab,
        pad_id=0,
        encoder_ids=None,
        stack="decoder",
        label=None,
        known=(),
        seed=0,
    ):
        self.model, self.x, self.tol = model, x, tol
        self.vocab, self.pad_id, self.enc = vocab, pad_id, encoder_ids
        self.stack, self.label = stack, label or stack  # the cache's stack name, the name shown
        self.known = set(known)  # (layer, head) already reported by the static checks
        self.T = x.shape[1]
        self.gen = torch.Generator().manual_seed(seed)
        self.findings: list[Finding] = []
        self.checks: list[dict[str, Any]] = []
        self.leaked = False
        self.out0: torch.Tensor | None = None
        # why suffix and gradient cannot run (NaN/inf outputs), None while they can
        self.nonfinite: str | None = None

    # -- helpers ---------------------------------------------------------------------------------
    def call(self, x, **kw):
        with torch.no_grad():
            return forward.outputs_of(forward.call(self.model, x, encoder_ids=self._enc(x), **kw))

    def _enc(self, x):
        return None if self.enc is None else self.enc.expand(x.shape[0], -1)

    def _replace(self, x: torch.Tensor, t: int) -> torch.Tensor:
        y = x.clone()
        n = self.T - t - 1
        if x.is_floating_point():
            y[:, t + 1 :] = torch.randn(y[:, t + 1 :].shape, generator=self.gen, dtype=y.dtype)
        else:
            shift = torch.randint(1, max(self.vocab, 2), (y.shape[0], n), generator=self.gen)
            y[:, t + 1 :] = (y[:, t + 1 :] + shift) % max(self.vocab, 2)
        return y

    def record(self, check, ok, fw, bw=0, detail=""):
        self.checks.append(
            {
                "check": check,
                "status": "pass" if ok else "fail",
                "forwards": fw,
                "backwards": bw,
                "detail": detail,
            }
        )

    def add(self, found: list[Finding], check: str) -> None:
        """Add localised findings from a functional check, except where the static checks already did."""
        for f in found:
            if (f.layer, f.head) in self.known:
                continue
            f.check, f.stack = check, self.label
            self.findings.append(f)
            self.known.add((f.layer, f.head))

    def skip(self, check, why):
        self.checks.append(
            {"check": check, "status": "skipped", "forwards": 0, "backwards": 0, "detail": why}
        )

    def trace(self, run, model=None) -> Any:
        """The cache of one traced forward, or None when probe cannot trace it (the check's
        verdict stands; the detail says the leak could not be localised, and why)."""
        try:
            with forward.trace(self.model if model is None else model) as tr, torch.no_grad():
                run()
        except ProbeError as e:
            self.checks[-1]["detail"] += f"; not localised: {str(e).splitlines()[0][:160]}"
            return None
        return tr.cache

    # -- (a) suffix perturbation -----------------------------------------------------------------
    def suffix(self, future_heads: dict[int, list[int]]) -> None:
        """Replace the tokens after t (several t, several draws); outputs at <= t must not move."""
        ts = cut_points(self.T)
        rows = [(t, self._replace(self.x, t)) for t in ts for _ in range(N_REPLACEMENTS)]
        batch = torch.cat([self.x] + [r for _, r in rows])
        out = self.call(batch)
        self.out0 = out[:1]
        self.nonfinite = _nonfinite(out, [t for t, _ in rows])
        if self.nonfinite is not None:
            self.skip("suffix", self.nonfinite)
            self.checks[-1]["forwards"] = 1  # it ran, and cannot be read
            return
        worst, where = 0.0, None
        for i, (t, _) in enumerate(rows):
            d = relative_change(out[i + 1, : t + 1], out[0, : t + 1])
            if d > worst:
                worst, where = d, (i, t)
        ok = worst <= self.tol["output"]
        self.record(
            "suffix",
            ok,
            1,
            detail=f"batch {len(rows) + 1}: the text + {len(rows)} random suffixes after t={ts}; "
            f"max change {worst:.3g}",
        )
        if ok:
            return
        self.leaked = True
        i, t = where
        # the earliest output position that moved
        out_i = out[i + 1, : t + 1].float()
        scale = float(out[0, : t + 1].abs().max()) or 1.0
        pos_change = (out_i - out[0, : t + 1].float()).abs().flatten(1).amax(-1) / scale
        q = int((pos_change > self.tol["output"]).nonzero()[0, 0])
        self._localise(rows[i][1], t, q, worst, future_heads)

    def _localise(self, perturbed, t, q, worst, future_heads) -> None:
        """Trace the text and its ``perturbed`` copy (one forward) to name the first layer whose
        residual stream at positions <= ``t`` changes, and the heads or sublayer to blame."""
        pair = torch.cat([self.x, perturbed])
        cache = self.trace(lambda: forward.call(self.model, pair, encoder_ids=self._enc(pair)))
        self.checks[-1]["forwards"] += 1
        if cache is None and future_heads:
            return  # the heads that look ahead are reported by the static checks already
        stack = None if cache is None else (self.stack if self.stack in cache.stacks else cache.stacks[-1])
        first = None if cache is None else self._first_changed(cache, stack, "resid_post", t)
        found = Finding("suffix_leak", self.label, first, None, q, t + 1, worst, check="suffix")
        if first is None:
            where = (
                "probe could not trace the perturbed forward to place it"
                if cache is None
                else "no layer's residual stream does (the leak is after the last layer)"
            )
            found.evidence = (
                f"outputs at positions <= {t} change (by {worst:.3g}) when only tokens after {t} "
                f"change; {where}"
            )
            self.findings.append(found)
            return
        heads = future_heads.get(first, [])
        if heads and any((first, h) in self.known for h in heads):
            self.checks[-1]["detail"] += f"; the stream first changes at layer {first}, heads {heads}"
            return
        if heads:
            found.head = heads[0]
            found.evidence = (
                f"outputs at positions <= {t} change by {worst:.3g} when only later tokens change; "
                f"the residual stream first changes at layer {first}, where heads {heads} "
                "attend to later keys"
            )
            self.findings.append(found)
            return
        if any(layer < first for layer in future_heads):
            return  # explained by an earlier layer's heads (already reported statically)
        d_attn, d_mlp = (
            self._change(cache, f"{stack}.blocks.{first}.{part}.delta", t) for part in ("self_attn", "mlp")
        )
        part = "the MLP sublayer" if d_mlp > self.tol["stream"] >= d_attn else "this layer"
        found.kind = "leak_outside_attention"
        found.evidence = (
            f"no head attends to later keys, yet the residual stream at positions <= {t} first "
            f"changes in layer {first}, in {part} (attention delta changed {d_attn:.3g}, "
            f"MLP delta {d_mlp:.3g}): something mixes positions outside attention, "
            "e.g. a token shift in the wrong direction"
        )
        self.findings.append(found)

    def _first_changed(self, cache, stack: str, name: str, t: int) -> int | None:
        """The first layer whose ``name`` tensor (text 0 vs text 1 of ``cache``) changes at
        positions <= ``t`` by more than the stream tolerance, or None."""
        for layer in range(cache.n_layers(stack)):
            if self._change(cache, f"{stack}.blocks.{layer}.{name}", t) > self.tol["stream"]:
                return layer
        return None

    @staticmethod
    def _change(cache, key: str, t: int) -> float:
        """:func:`relative_change` of ``cache[key]`` between its texts 1 and 0 at positions <= ``t``
        (0 when the cache lacks the key)."""
        if key not in cache:
            return 0.0
        s = cache[key]
        return relative_change(s[1, : t + 1], s[0, : t + 1])

    # -- (b) gradient ----------------------------------------------------------------------------
    def gradient(self, explained: bool = False) -> None:
        """d output_i / d input-embedding_j must be zero for j > i (one backward over a batch).

        ``explained``: heads that attend to later keys are reported already; a failure then adds
        no unlocalised finding of its own."""
        if self.nonfinite is not None:
            self.skip("gradient", self.nonfinite)
            return
        ts = cut_points(self.T)
        batch = self.x.expand(len(ts), *self.x.shape[1:]).clone()
        out_shape = self.out0.shape if self.out0 is not None else self.call(self.x).shape
        w = torch.randn((len(ts),) + tuple(out_shape[1:]), generator=self.gen)
        for b, t in enumerate(ts):
            w[b, t + 1 :] = 0
        try:
            g = forward.input_gradient(self.model, batch, w, encoder_ids=self._enc(batch))
        except RuntimeError as e:
            self.skip("gradient", f"no gradient path ({str(e).splitlines()[0]})")
            return
        if not bool(torch.isfinite(g).all()):
            self.skip("gradient", "the gradient of the model's outputs is NaN/inf")
            self.checks[-1].update(forwards=1, backwards=1)
            return
        norms = g.float().flatten(2).norm(dim=-1)  # [B, T]
        worst, where = 0.0, None
        for b, t in enumerate(ts):
            ref = float(norms[b, : t + 1].max()) or 1.0
            later = norms[b, t + 1 :] / ref
            if later.numel() and float(later.max()) > worst:
                worst, where = float(later.max()), (t, t + 1 + int(later.argmax()))
        ok = worst <= self.tol["grad"]
        self.record(
            "gradient",
            ok,
            1,
            1,
            f"batch {len(ts)}: cut points {ts}; max relative gradient on later inputs {worst:.3g}",
        )
        if not ok:
            was, self.leaked = self.leaked, True
            if not was and not explained:
                t, j = where
                self.findings.append(
                    Finding(
                        "gradient_leak",
                        self.label,
                        None,
                        None,
                        t,
                        j,
                        worst,
                        f"outputs at positions <= {t} have a gradient {worst:.3g} (relative) with respect "
                        f"to the input embedding at position {j}",
                        check="gradient",
                    )
                )
