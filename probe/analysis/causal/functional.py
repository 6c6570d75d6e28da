"""Causal checks that run the model (through :mod:`probe.forward` only) and catch leaks anywhere.

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
from probe.analysis.causal.static import check_pattern
from probe.errors import ProbeError

N_REPLACEMENTS = 2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
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
        self._out0: torch.Tensor | None = None

    # -- helpers ---------------------------------------------------------------------------------
    def _call(self, x, **kw):
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

    def _record(self, check, ok, fw, bw=0, detail=""):
        self.checks.append(
            {
                "check": check,
                "status": "pass" if ok else "fail",
                "forwards": fw,
                "backwards": bw,
                "detail": detail,
            }
        )

    def _add(self, found: list[Finding], check: str) -> None:
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

    def _trace(self, run, model=None) -> Any:
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
        out = self._call(batch)
        self._out0 = out[:1]
        worst, where = 0.0, None
        for i, (t, _) in enumerate(rows):
            d = _rel(out[i + 1, : t + 1], out[0, : t + 1])
            if d > worst:
                worst, where = d, (i, t)
        ok = worst <= self.tol["output"]
        self._record(
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
        pair = torch.cat([self.x, perturbed])
        cache = self._trace(lambda: forward.call(self.model, pair, encoder_ids=self._enc(pair)))
        self.checks[-1]["forwards"] += 1
        first = None
        stack = None if cache is None else (self.stack if self.stack in cache.stacks else cache.stacks[-1])
        for layer in range(cache.n_layers(stack) if cache is not None else 0):
            k = f"{stack}.blocks.{layer}.resid_post"
            if k not in cache:
                continue
            s = cache[k]
            if _rel(s[1, : t + 1], s[0, : t + 1]) > self.tol["stream"]:
                first = layer
                break
        heads = [] if first is None else future_heads.get(first, [])
        if cache is None and future_heads:
            return  # the heads that look ahead are reported by the static checks already
        if first is None:
            where = (
                "probe could not trace the perturbed forward to place it"
                if cache is None
                else "no layer's residual stream does (the leak is after the last layer)"
            )
            self.findings.append(
                Finding(
                    "suffix_leak",
                    self.label,
                    None,
                    None,
                    q,
                    t + 1,
                    worst,
                    f"outputs at positions <= {t} change (by {worst:.3g}) when only tokens after {t} "
                    f"change; {where}",
                    check="suffix",
                )
            )
            return
        attn_k, mlp_k = f"{stack}.blocks.{first}.self_attn.delta", f"{stack}.blocks.{first}.mlp.delta"
        d_attn = _rel(cache[attn_k][1, : t + 1], cache[attn_k][0, : t + 1]) if attn_k in cache else None
        d_mlp = _rel(cache[mlp_k][1, : t + 1], cache[mlp_k][0, : t + 1]) if mlp_k in cache else None
        if heads and any((first, h) in self.known for h in heads):
            self.checks[-1]["detail"] += f"; the stream first changes at layer {first}, heads {heads}"
            return
        if heads:
            self.findings.append(
                Finding(
                    "suffix_leak",
                    self.label,
                    first,
                    heads[0],
                    q,
                    t + 1,
                    worst,
                    f"outputs at positions <= {t} change by {worst:.3g} when only later tokens change; "
                    f"the residual stream first changes at layer {first}, where heads {heads} "
                    "attend to later keys",
                    check="suffix",
                )
            )
            return
        earlier = sorted(layer for layer in future_heads if layer < first)
        if earlier:
            return  # explained by an earlier layer's heads (already reported statically)
        part = "the MLP sublayer" if (d_mlp or 0) > self.tol["stream"] >= (d_attn or 0) else "this layer"
        self.findings.append(
            Finding(
                "leak_outside_attention",
                self.label,
                first,
                None,
                q,
                t + 1,
                worst,
                f"no head attends to later keys, yet the residual stream at positions <= {t} first "
                f"changes in layer {first}, in {part} (attention delta changed {d_attn or 0:.3g}, "
                f"MLP delta {d_mlp or 0:.3g}): something mixes positions outside attention, "
                "e.g. a token shift in the wrong direction",
                check="suffix",
            )
        )

    # -- (b) gradient ----------------------------------------------------------------------------
    def gradient(self) -> None:
        """d output_i / d input-embedding_j must be zero for j > i (one backward over a batch)."""
        ts = cut_points(self.T)
        batch = self.x.expand(len(ts), *self.x.shape[1:]).clone()
        out_shape = self._out0.shape if self._out0 is not None else self._call(self.x).shape
        w = torch.randn((len(ts),) + tuple(out_shape[1:]), generator=self.gen)
        for b, t in enumerate(ts):
            w[b, t + 1 :] = 0
        try:
            g = forward.input_gradient(self.model, batch, w, encoder_ids=self._enc(batch))
        except RuntimeError as e:
            self.skip("gradient", f"no gradient path ({str(e).splitlines()[0]})")
            return
        norms = g.float().flatten(2).norm(dim=-1)  # [B, T]
        worst, where = 0.0, None
        for b, t in enumerate(ts):
            ref = float(norms[b, : t + 1].max()) or 1.0
            later = norms[b, t + 1 :] / ref
            if later.numel() and float(later.max()) > worst:
                worst, where = float(later.max()), (t, t + 1 + int(later.argmax()))
        ok = worst <= self.tol["grad"]
        self._record(
            "gradient",
            ok,
            1,
            1,
            f"batch {len(ts)}: cut points {ts}; max relative gradient on later inputs {worst:.3g}",
        )
        if not ok:
            was, self.leaked = self.leaked, True
            if not was:
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

    # -- (c) padding -----------------------------------------------------------------------------
    def padding(self, expect) -> None:
        """Left- and right-padded copies of a shorter text equal the unpadded run on real tokens."""
        was = self.leaked
        T = self.T
        k = max(1, T // 3)
        short = self.x[:, : T - k]
        pad = torch.full((1, k), self.pad_id, dtype=self.x.dtype)
        ids = torch.cat([self.x, torch.cat([pad, short], 1), torch.cat([short, pad], 1)])
        mask = torch.ones_like(ids)
        mask[1, :k] = 0
        mask[2, T - k :] = 0
        out = self._call(ids, attention_mask=mask)
        ref = out[0, : T - k]
        d_left, d_right = _rel(out[1, k:], ref), _rel(out[2, : T - k], ref)
        ok = max(d_left, d_right) <= self.tol["output"]
        self._record(
            "padding",
            ok,
            1,
            detail=f"batch 3: {k} pads left, right, none; change {d_left:.3g}, {d_right:.3g}",
        )
        if ok:
            return
        self.leaked = True
        cache = self._trace(lambda: forward.call(self.model, ids, attention_mask=mask))
        self.checks[-1]["forwards"] += 1
        found = []
        stack = cache.stacks[-1] if cache is not None else None
        for layer in range(cache.n_layers(stack) if cache is not None else 0):
            try:
                p = cache.pattern(stack, layer)
            except KeyError:
                continue
            f, _ = check_pattern(
                p, mask.bool(), mask.bool(), expect, self.tol, {"stack": stack, "layer": layer}
            )
            found += [x for x in f if x.kind in ("pad_attention", "mask_over_queries")]
        if found:
            self._add(found, "padding")
            return
        if was:
            return  # explained by the leak found above
        side = "left" if d_left > d_right else "right"
        self.findings.append(
            Finding(
                "padding_mismatch",
                None,
                None,
                None,
                None,
                None,
                max(d_left, d_right),
                f"{side}-padded outputs differ from the unpadded run by {max(d_left, d_right):.3g} "
                "although no head attends to pads (positions shifted by padding?)",
                check="padding",
            )
        )

    # -- (d) KV cache ----------------------------------------------------------------------------
    def kv_cache(self, expect) -> None:
        """Prefix, then a chunk, then one token through the KV cache equal the full forward."""
        was = self.leaked
        T = self.T
        n = T // 2
        with torch.no_grad():
            o1 = forward.call(self.model, self.x[:, :n], use_cache=True)
            past = getattr(o1, "past_key_values", None)
            if past is None:
                self.skip("kv_cache", "the model returned no past_key_values")
                return
            o2 = forward.call(self.model, self.x[:, n : T - 1], past_key_values=past, use_cache=True)
            o3 = forward.call(self.model, self.x[:, T - 1 :], past_key_values=o2.past_key_values)
        inc = torch.cat([forward.outputs_of(o) for o in (o1, o2, o3)], 1)
        full = self._out0 if self._out0 is not None else self._call(self.x)
        d = _rel(inc, full)
        ok = d <= self.tol["output"]
        self._record(
            "kv_cache", ok, 3, detail=f"prefix {n}, chunk {T - 1 - n}, then 1 token; max change {d:.3g}"
        )
        if ok:
            return
        self.leaked = True
        with torch.no_grad():
            past = forward.call(self.model, self.x[:, :n], use_cache=True).past_key_values
        chunk = self.x[:, n : T - 1]
        cache = self._trace(lambda: forward.call(self.model, chunk, past_key_values=past, use_cache=True))
        self.checks[-1]["forwards"] += 2
        found = []
        for stack in cache.stacks if cache is not None else []:
            for layer in range(cache.n_layers(stack)):
                for kind in ("self", "cross"):
                    try:
                        p = cache.pattern(stack, layer, kind)
                    except KeyError:
                        continue
                    ones_q = torch.ones(p.shape[0], p.shape[2], dtype=torch.bool)
                    ones_k = torch.ones(p.shape[0], p.shape[3], dtype=torch.bool)
                    f, _ = check_pattern(
                        p, ones_q, ones_k, expect, self.tol, {"stack": self.stack, "layer": layer}
                    )
                    found += f
        if found:
            self._add(found, "kv_cache")
            return
        if was:
            return
        self.findings += [
            Finding(
                "kv_cache_mismatch",
                self.label,
                None,
                None,
                n,
                None,
                d,
                f"decoding with the KV cache differs from the full forward by {d:.3g}",
                check="kv_cache",
            )
        ]

    # -- (e) backend parity ----------------------------------------------------------------------
    def backend(self) -> None:
        """Eager and SDPA attention give the same outputs (transformers models that offer both)."""
        other = forward.other_backend(self.model)
        if other is None:
            self.skip("backend", "the model offers one attention backend")
            return
        current, name, twin = other
        was = self.leaked
        full = self._out0 if self._out0 is not None else self._call(self.x)
        with torch.no_grad():
            alt = forward.outputs_of(forward.call(twin, self.x))
        d = _rel(alt, full)
        ok = d <= self.tol["output"]
        self._record("backend", ok, 1, detail=f"{current} vs {name}: max change {d:.3g}")
        if ok:
            return
        self.leaked = True
        if was:
            return
        caches = [self._trace(lambda m=m: forward.call(m, self.x), model=m) for m in (self.model, twin)]
        self.checks[-1]["forwards"] += 2
        # compare layer by layer; each cache names its own lone stack (a leaky one looks like an encoder)
        ok_caches = None not in caches
        sa, sb = (caches[0].stacks[-1], caches[1].stacks[-1]) if ok_caches else (None, None)
        n = min(caches[0].n_layers(sa), caches[1].n_layers(sb)) if ok_caches else 0
        for layer in range(n):
            a, b = caches[0].pattern(sa, layer), caches[1].pattern(sb, layer)
            diff = (a.float() - b.float()).abs().amax(dim=(0, 2, 3))
            if float(diff.max()) > self.tol["mass"] * 10:
                h = int(diff.argmax())
                self.findings.append(
                    Finding(
                        "backend_mismatch",
                        self.label,
                        layer,
                        h,
                        None,
                        None,
                        float(diff.max()),
                        f"{current} and {name} attention differ (first at this layer, max weight "
                        f"difference {float(diff.max()):.3g})",
                        check="backend",
                    )
                )
                return
        self.findings.append(
            Finding(
                "backend_mismatch",
                None,
                None,
                None,
                None,
                None,
                d,
                f"{current} and {name} outputs differ by {d:.3g}",
                check="backend",
            )
        )
