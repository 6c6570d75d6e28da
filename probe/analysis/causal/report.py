"""The result of :func:`probe.check_causal`: findings, the checks that ran, and the tolerances used."""

from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from probe.analysis.table import Table

# One tolerance table for every check, per dtype the model computed in. A number at or under its
# tolerance is numerical noise, never a leak:
#   mass    attention weight above the diagonal / on padding keys, summed over a row
#   rowsum  |sum of a row - 1|
#   output  max |change| of an output at positions that must not change, relative to max |output|
#   grad    max |d output / d later input| relative to max |d output / d earlier input|
#   stream  max |change| of a layer's residual stream, relative to max |stream|
TOLERANCES: dict[str, dict[str, float]] = {
    "float32": {"mass": 1e-6, "rowsum": 1e-4, "output": 1e-5, "grad": 1e-6, "stream": 1e-5},
    "float16": {"mass": 1e-3, "rowsum": 1e-2, "output": 5e-3, "grad": 1e-3, "stream": 5e-3},
    "bfloat16": {"mass": 1e-2, "rowsum": 3e-2, "output": 3e-2, "grad": 1e-2, "stream": 3e-2},
}

# What each finding kind means, shown in the report and the docs.
KINDS: dict[str, str] = {
    "future_attention": "weight on keys after the query (the causal mask is missing or wrong)",
    "unmasked_head": "one head attends to the future while the other heads of its layer are causal",
    "swapped_mask": "the past is masked and the future visible (tril/triu swapped)",
    "masked_diagonal": "each token is hidden from itself (triu(diagonal=0) instead of 1); row 0 has no key",
    "non_finite": "NaN/inf attention rows (e.g. a mask constant that overflows in half precision)",
    "rows_not_normalised": "attention rows that do not sum to 1",
    "mask_after_softmax": "the mask is applied after the softmax without renormalising: "
    "the future still sets the normaliser",
    "pad_attention": "real tokens attend to padding keys (the padding mask is ignored)",
    "mask_over_queries": "the padding mask is broadcast over queries instead of keys",
    "window_too_wide": "a sliding window that reaches further back than declared",
    "kv_alignment": "with a KV cache the causal mask is aligned top-left instead of bottom-right",
    "leak_outside_attention": "outputs depend on later tokens although no head attends to them",
    "suffix_leak": "outputs at a position change when only later tokens change",
    "gradient_leak": "outputs have a non-zero gradient with respect to later input embeddings",
    "padding_mismatch": "padded and unpadded runs disagree on real tokens",
    "kv_cache_mismatch": "incremental decoding with a KV cache disagrees with the full forward",
    "backend_mismatch": "eager and SDPA attention disagree",
}


@dataclass
class Finding:
    """One problem: what (``kind``), where (stack, layer, head, query/key positions), how much."""

    kind: str
    stack: str | None = None
    layer: int | None = None
    head: int | None = None
    query: int | None = None
    key: int | None = None
    magnitude: float = 0.0
    evidence: str = ""
    check: str = "static"  # static (from the cache) or the functional check that found it
    text: int | None = None  # batch index of the text it was seen in

    def where(self) -> str:
        """A short location like ``decoder L1 H2 q5→k7``."""
        parts = []
        if self.stack is not None:
            parts.append(self.stack)
        if self.layer is not None:
            parts.append(f"L{self.layer}")
        if self.head is not None:
            parts.append(f"H{self.head}")
        if self.query is not None:
            parts.append(f"q{self.query}" + (f"→k{self.key}" if self.key is not None else ""))
        return " ".join(parts) or "model"


# The checks of one audit: the static checks read the capture (its check record is "capture"); the
# functional ones run the model. A check that did not run is named in the verdict with the reason.
CHECKS = ("static", "suffix", "gradient", "padding", "kv_cache", "backend")
FUNCTIONAL = CHECKS[1:]

COLUMNS = ["kind", "stack", "layer", "head", "query", "key", "magnitude", "check", "evidence"]
CHECK_COLUMNS = ["check", "status", "forwards", "backwards", "detail"]


@dataclass
class CausalReport:
    """The verdict of :func:`probe.check_causal`.

    ``ok`` is True when no finding was made. ``findings`` lists problems with their location;
    ``checks`` says which checks ran (status ``pass``/``fail``/``skipped``) and what they cost in
    forwards and backwards; ``expected`` is what each stack was held to (``causal``,
    ``bidirectional`` or ``window N``); ``notes`` are things worth knowing that are not leaks;
    ``grids[stack]`` holds per layer x head ``future`` and ``pad`` mass (max over rows) and the
    ``window`` actually used, for the report's heatmaps. ``functional_skipped`` says why the
    functional checks did not run at all (a cache alone, ``functional=False``, no causal stack,
    too short a text), None when they ran; :attr:`not_run` names every check that did not run.
    """

    findings: list[Finding] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)
    expected: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    grids: dict[str, dict[str, list[list[float]]]] = field(default_factory=dict)
    dtype: str = "float32"
    model: str = "?"
    functional_skipped: str | None = None

    @property
    def ok(self) -> bool:
        """True when the audit found no leak and no broken row (:attr:`complete` says whether
        every check ran; the verdict names those that did not)."""
        return not self.findings

    @property
    def table(self) -> Table:
        """The findings as a :class:`~probe.analysis.table.Table` (one row per finding)."""
        rows = [{c: getattr(f, c) for c in COLUMNS} for f in self.findings]
        return Table(rows, COLUMNS, title="causal-mask findings")

    @property
    def check_table(self) -> Table:
        """The checks that ran, their status and cost, as a Table."""
        return Table(self.checks, CHECK_COLUMNS, title="checks")

    def kinds(self) -> set[str]:
        """The distinct finding kinds."""
        return {f.kind for f in self.findings}

    def cost(self) -> tuple[int, int]:
        """(forwards, backwards) the functional checks ran (the captures included)."""
        return (
            sum(int(c.get("forwards") or 0) for c in self.checks),
            sum(int(c.get("backwards") or 0) for c in self.checks),
        )

    @property
    def not_run(self) -> dict[str, str]:
        """``{check: why}`` for each of :data:`CHECKS` that did not run, in that order (empty when
        the audit is complete). The static checks always run."""
        skipped = {c["check"]: str(c.get("detail") or "") for c in self.checks if c["status"] == "skipped"}
        ran = {c["check"] for c in self.checks if c["status"] != "skipped"}
        out = {}
        for check in FUNCTIONAL:
            if check in skipped:
                out[check] = skipped[check]
            elif check not in ran:
                out[check] = self.functional_skipped or "not reached"
        return out

    @property
    def complete(self) -> bool:
        """True when every one of :data:`CHECKS` ran (:attr:`not_run` is empty)."""
        return not self.not_run

    def to_dict(self) -> dict[str, Any]:
        """Plain data: ok, complete, verdict, model, dtype, expected, findings, checks, not_run
        (``{check: why}``), functional_skipped, notes, grids, tolerances."""
        return {
            "ok": self.ok,
            "complete": self.complete,
            "verdict": self.verdict(),
            "model": self.model,
            "dtype": self.dtype,
            "expected": dict(self.expected),
            "findings": [asdict(f) for f in self.findings],
            "checks": list(self.checks),
            "not_run": self.not_run,
            "functional_skipped": self.functional_skipped,
            "notes": list(self.notes),
            "grids": self.grids,
            "tolerances": TOLERANCES.get(self.dtype, TOLERANCES["float32"]),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`to_dict` as JSON."""
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)

    def verdict(self) -> str:
        """One line: what was found, and every check that did not run with the reason.

        ``OK: no leak found (decoder: causal)`` when all :data:`CHECKS` ran;
        ``OK on 5 of 6 checks: no leak found (decoder: causal); kv_cache not run: <why>`` when some
        did not (checks with the same reason share it: ``padding, kv_cache not run: <why>``);
        ``LEAK: 2 finding(s): <kinds>``, followed by the same ``; <check> not run: <why>`` parts."""
        missing = self.not_run
        by_reason: dict[str, list[str]] = {}
        for check, why in missing.items():
            by_reason.setdefault(why, []).append(check)
        gaps = "".join(f"; {', '.join(checks)} not run: {why}" for why, checks in by_reason.items())
        if not self.ok:
            return f"LEAK: {len(self.findings)} finding(s): {', '.join(sorted(self.kinds()))}{gaps}"
        held = ", ".join(f"{s}: {e}" for s, e in self.expected.items())
        if not missing:
            return f"OK: no leak found ({held})"
        return f"OK on {len(CHECKS) - len(missing)} of {len(CHECKS)} checks: no leak found ({held}){gaps}"

    def __str__(self) -> str:
        lines = [f"causal-mask audit of {self.model}: {self.verdict()}"]
        if self.findings:
            short = [c for c in COLUMNS if c != "evidence"]
            rows = [{"#": i + 1, **{c: getattr(f, c) for c in short}} for i, f in enumerate(self.findings)]
            lines.append(Table(rows, ["#"] + short).to_text(max_rows=20))
            lines.extend(f"  {i + 1}. {f.evidence}" for i, f in enumerate(self.findings[:20]))
        fw, bw = self.cost()
        ran = [f"{c['check']} {'not run' if c['status'] == 'skipped' else c['status']}" for c in self.checks]
        if ran:
            lines.append(
                f"checks: {'; '.join(ran)}  (cost: {_passes(fw, 'forward')}, {_passes(bw, 'backward')})"
            )
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(line for line in lines if line)

    def __repr__(self) -> str:
        return f"<CausalReport ok={self.ok} findings={len(self.findings)} model={self.model!r}>"

    def _repr_html_(self) -> str:
        colour = ("#1a7f37" if self.complete else "#9a6700") if self.ok else "#cf222e"
        parts = [
            f'<div class="probe-causal"><p style="color:{colour};font-weight:bold">'
            f"{html.escape(self.verdict())}</p>"
        ]
        if self.findings:
            parts.append(self.table._repr_html_())
        parts.append(self.check_table._repr_html_())
        if self.notes:
            parts.append("<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in self.notes) + "</ul>")
        parts.append("</div>")
        return "".join(parts)


def _passes(n: int, what: str) -> str:
    """``1 forward``, ``3 forwards``, ``0 backwards``."""
    return f"{n} {what}" if n == 1 else f"{n} {what}s"
