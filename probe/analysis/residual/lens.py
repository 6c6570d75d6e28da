"""The logit lens: every layer's residual stream read through the model's own final norm and unembedding.

``logit_lens(model, text_or_cache)`` runs the model once through :mod:`probe.forward` (recording its
leaf submodules, and capturing the cache when a text is given), finds the read-out
(:mod:`probe.analysis.residual.head`), and reads each layer's ``resid_post`` (and the embedding,
``resid_pre`` of layer 0) as the model would read its last one: top-k tokens and the probability of
the token the model finally predicts, per layer and position. Each sublayer delta is read the same
way (the delta alone through the real norm). The last layer's read-out reproduces the model's
logits; :attr:`LogitLens.final_error` is the largest difference, which tests hold to ≤ 1e-5.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from probe import forward
from probe.analysis.residual.exports import TableExports
from probe.analysis.residual.head import ReadOut, find_readout, is_leaf, model_logits
from probe.analysis.residual.stream import captured_layers, layer_components
from probe.analysis.table import Table
from probe.cache.format import key
from probe.errors import ProbeError

_MISSING = object()


def _readout_name(ro: ReadOut) -> str:
    """``"ln_f -> lm_head"``, or ``"projection, with no final norm"`` when the unembedding reads
    the last stream itself."""
    return (
        f"{ro.norm_name} -> {ro.unembed_name}" if ro.norm_name else f"{ro.unembed_name}, with no final norm"
    )


@dataclass
class Pass:
    """One recorded forward: the cache, the read-out, the model's logits and the stack read."""

    cache: Any
    readout: ReadOut
    logits: Tensor  # [batch, pos, vocab], the model's own
    stack: str
    layers: list[int]
    calls: list
    tokens: list[list[str]]
    mask: Tensor  # [batch, pos] bool, real tokens
    tokenizer: Any


def _decoder_tokenizer(model, tokenizer, cache) -> Any:
    raw = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    if raw is None:
        return None
    if cache.metadata.get("target_tokens") and not forward.is_hf_model(model):
        raw = getattr(raw, "target", raw)
    return forward.adapt_tokenizer(raw)


def read_pass(model, inputs, *, tokenizer=None, target=None, norm=_MISSING, unembed=None) -> Pass:
    """Run ``model`` once on ``inputs`` (texts, or a :class:`probe.Cache` whose texts are re-run)."""
    from probe.cache import Cache

    given = inputs if isinstance(inputs, Cache) else None
    if given is not None:
        meta = given.metadata
        if not meta.get("texts"):
            raise ProbeError("the cache holds no texts to re-run; give the text instead of the cache")
        inputs = meta["texts"]
        if target is None and meta.get("target_texts") and meta.get("target_source") == "given":
            target = meta["target_texts"]
    rec = forward.run_recorded(
        model, inputs, tokenizer=tokenizer, target=target, record=is_leaf, capture_cache=given is None
    )
    cache = given if given is not None else rec.cache
    stack = "decoder" if "decoder" in cache.stacks else cache.stacks[-1]
    layers = captured_layers(cache, stack)
    n = cache.metadata.get("stacks", {}).get(stack, {}).get("layers", len(layers))
    if not layers or layers[-1] != n - 1:
        raise ProbeError(
            f"the logit lens needs the last {stack} layer ({n - 1}) in the cache; capture all layers"
        )
    final = cache[key(stack, layers[-1], "resid_post")]
    logits = model_logits(rec.outputs)
    if given is not None and final.shape[:2] != logits.shape[:2]:
        raise ProbeError(
            "the cache does not match this model's forward on its texts; capture it with this model"
        )
    readout = find_readout(
        rec.calls,
        rec.outputs,
        final,
        norm=None if norm is _MISSING else norm,
        unembed=unembed,
        given_norm=norm is not _MISSING,
    )
    prefix = "target_" if stack == "decoder" and cache.metadata.get("target_tokens") else ""
    toks = cache.metadata.get(f"{prefix}tokens") or [[str(t) for t in range(final.shape[1])]] * final.shape[0]
    m = cache.metadata.get(f"{prefix}attention_mask")
    mask = torch.tensor(m, dtype=torch.bool) if m else torch.ones(final.shape[:2], dtype=torch.bool)
    return Pass(
        cache,
        readout,
        logits.detach().float(),
        stack,
        layers,
        rec.calls,
        toks,
        mask,
        _decoder_tokenizer(model, tokenizer, cache),
    )


@dataclass
class LogitLens(TableExports):
    """Per layer and position: what the stream would predict if the model stopped there.

    ``sources`` label the rows (``"embed"``, then ``"L0"``, ``"L1"``, ... for each layer's
    ``resid_post``; then ``"L0.self_attn.delta"``, ... for each delta). ``p_pred`` ``[row, batch,
    pos]`` is the probability of the model's final prediction ``predicted`` ``[batch, pos]``;
    ``top_ids``/``top_p`` ``[row, batch, pos, k]`` the top-k tokens. ``final_error`` is
    max |last-layer lens logits - model logits|. ``attribution`` holds the direct logit attribution.
    """

    stack: str
    sources: list[str]
    n_stream_rows: int
    tokens: list[list[str]]
    mask: Tensor
    predicted: Tensor
    p_pred: Tensor
    top_ids: Tensor
    top_p: Tensor
    final_error: float
    vocab: list[str] | None
    readout: str
    attribution: Any = None
    notes: list[str] = field(default_factory=list)

    def main_table(self) -> Table:
        """The table ``to_json``/``to_csv``/``to_pandas`` export."""
        return self.table()

    def token(self, i: int) -> str:
        """The display string of vocabulary id ``i``."""
        return self.vocab[i] if self.vocab is not None and i < len(self.vocab) else str(i)

    def grid(
        self, batch: int = 0, deltas: bool = False
    ) -> tuple[list[str], list[str], Tensor, list[list[str]]]:
        """``(row labels, position tokens, p_pred [rows, pos], top-1 tokens [rows][pos])`` for one text."""
        rows = range(self.n_stream_rows, len(self.sources)) if deltas else range(self.n_stream_rows)
        T = int(self.mask[batch].sum())
        pos = [t for t in range(self.mask.shape[1]) if self.mask[batch, t]][:T]
        p = self.p_pred[list(rows)][:, batch][:, pos]
        tops = [[self.token(int(self.top_ids[r, batch, t, 0])) for t in pos] for r in rows]
        return [self.sources[r] for r in rows], [self.tokens[batch][t] for t in pos], p, tops

    def table(self) -> Table:
        """One row per (source, batch, pos): token, predicted, p_predicted, top-k tokens and probabilities."""
        rows = []
        R, B, T, k = self.top_ids.shape
        ids, ps, pp = self.top_ids.tolist(), self.top_p.tolist(), self.p_pred.tolist()
        for r in range(R):
            for b in range(B):
                for t in range(T):
                    if not self.mask[b, t]:
                        continue
                    rows.append(
                        {
                            "source": self.sources[r],
                            "batch": b,
                            "pos": t,
                            "token": self.tokens[b][t],
                            "predicted": self.token(int(self.predicted[b, t])),
                            "p_predicted": pp[r][b][t],
                            "top": [self.token(i) for i in ids[r][b][t]],
                            "top_p": ps[r][b][t],
                        }
                    )
        cols = ["source", "batch", "pos", "token", "predicted", "p_predicted", "top", "top_p"]
        return Table(rows, cols, "logit lens")

    def to_dict(self) -> dict[str, Any]:
        """The lens table and the attribution table as plain Python."""
        d = {"lens": self.table().to_dict(), "final_error": self.final_error, "readout": self.readout}
        if self.attribution is not None:
            d["attribution"] = self.attribution.table.to_dict()
        return d

    def to_text(self, batch: int = 0, width: int | None = None) -> str:
        """The grid as text: one line per row, the top-1 token and p(final prediction) per position.

        With ``width``, positions that do not fit on ``width`` characters go to further blocks
        below, each with the row labels again (position numbers head each block's columns)."""
        labels, toks, p, tops = self.grid(batch)
        final = [
            self.token(int(self.predicted[batch, t]))
            for t in range(self.mask.shape[1])
            if self.mask[batch, t]
        ]
        w = max(len(x) for x in [*labels, "final"])
        per = len(toks) if width is None else max(1, (width - w - 2) // 14)
        blocks = []
        for a in range(0, len(toks), per):
            cols = range(a, min(a + per, len(toks)))
            lines = [f"{'':{w}}  " + "  ".join(f"{t!r:>12}" for t in toks[a : cols.stop])]
            if width is not None and per < len(toks):
                lines.insert(0, f"{'':{w}}  " + "  ".join(f"{'pos ' + str(j):>12}" for j in cols))
            for i, lab in enumerate(labels):
                cells = "  ".join(f"{tops[i][j]!r:>6} {p[i, j].item():.2f}".rjust(12) for j in cols)
                lines.append(f"{lab:{w}}  {cells}")
            lines.append(f"{'final':{w}}  " + "  ".join(f"{final[j]!r:>12}" for j in cols))
            blocks.append("\n".join(lines))
        return "\n\n".join(blocks)

    def __str__(self) -> str:
        return (
            f"logit lens via {self.readout}; last layer vs model logits: max |diff| {self.final_error:.2e}\n"
            + self.to_text()
        )


def _vocab(tok, n: int) -> list[str] | None:
    if tok is None:
        return None
    try:
        return list(tok.tokens_of(list(range(n))))
    except Exception:  # a tokenizer that cannot show every id: fall back to ids
        return None


def lens_from_pass(ps: Pass, k: int = 5) -> LogitLens:
    """Build the :class:`LogitLens` of a recorded :class:`Pass`."""
    from probe.analysis.residual.attribution import attribute

    cache, ro, stack = ps.cache, ps.readout, ps.stack
    streams: list[tuple[str, Tensor]] = []
    deltas: list[tuple[str, Tensor]] = []
    notes: list[str] = []
    for i in ps.layers:
        pre, parts, note = layer_components(cache, stack, i)
        if note:
            notes.append(note)
        if i == 0:
            streams.append(("embed", pre))
        streams.append((f"L{i}", cache[key(stack, i, "resid_post")]))
        deltas += [(f"L{i}.{s}" + (".delta" if s != "layer" else ""), d) for s, d in parts]
    sources, ps_pred, tids, tps = [], [], [], []
    pred = ps.logits.argmax(dim=-1)
    final_error = float("nan")
    for label, h in streams + deltas:
        lg = ro.logits(h)
        if label == f"L{ps.layers[-1]}":
            final_error = (lg - ps.logits).abs().max().item()
            if final_error > 1e-4 * (1 + ps.logits.abs().max().item()):
                # something acts between the unembedding and the output (a logits bias, a scale):
                # every row would be off by it, so say so instead of showing a wrong lens
                raise ProbeError(
                    f"the read-out {_readout_name(ps.readout)} "
                    f"does not reproduce the model's logits (max |diff| {final_error:.3g}); "
                    "pass norm= and unembed= the modules that map the last stream to the logits"
                )
        prob = lg.softmax(dim=-1)
        kk = min(k, prob.shape[-1])
        tp, ti = prob.topk(kk, dim=-1)
        sources.append(label)
        ps_pred.append(prob.gather(-1, pred.unsqueeze(-1)).squeeze(-1))
        tids.append(ti)
        tps.append(tp)
    lens = LogitLens(
        stack,
        sources,
        len(streams),
        ps.tokens,
        ps.mask,
        pred,
        torch.stack(ps_pred),
        torch.stack(tids),
        torch.stack(tps),
        final_error,
        _vocab(ps.tokenizer, ps.logits.shape[-1]),
        _readout_name(ps.readout),
        notes=notes,
    )
    lens.attribution = attribute(ps, lens)
    return lens


def logit_lens(
    model,
    inputs,
    *,
    tokenizer: Any = None,
    target: Any = None,
    k: int = 5,
    norm: Any = _MISSING,
    unembed: Any = None,
) -> LogitLens:
    """The logit lens (and direct logit attribution) of ``model`` on ``inputs``.

    ``inputs``: a text, a list of texts, or a :class:`probe.Cache` made from this model (its texts
    are run again to find the read-out; its tensors are read). ``k`` top tokens per cell.
    ``norm``/``unembed`` override the automatic search (``norm=None``: the model has no final
    norm). Returns a :class:`LogitLens`; ``.attribution`` is the
    :class:`~probe.analysis.residual.attribution.Attribution`.
    """
    if k < 1:
        raise ProbeError(f"k must be at least 1, got {k}")
    ps = read_pass(model, inputs, tokenizer=tokenizer, target=target, norm=norm, unembed=unembed)
    return lens_from_pass(ps, k)


__all__ = ["LogitLens", "logit_lens", "read_pass", "lens_from_pass", "Pass"]
