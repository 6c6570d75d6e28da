"""The rows that wrote the generated tokens, read from whatever a generation cache kept.

Whole patterns hold every row. ``keep={"rows": [...]}`` holds the kept query rows exactly over
every key: a generated token whose writing row was not kept is unknown (NaN). ``keep={"topk":
k}`` holds the ``k`` largest weights of every row: a row is known exactly only where those keys
hold the whole row (``topk_mass`` at least ``1 - MASS_TOL``: every other weight is below
``MASS_TOL``, taken as 0); elsewhere only the kept keys are known and the others are NaN.
``keep="stats"`` holds no row at all and is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from probe.analysis.generation.steps import Steps
from probe.errors import ProbeError

MASS_TOL = 1e-5  # a top-k row whose kept keys hold at least 1 - MASS_TOL of it is the whole row


def check_kept(cache: Any) -> str:
    """``"patterns"``, ``"rows"`` or ``"topk"``: what the cache kept of each row; a one-line error
    for ``keep="stats"`` (no row of any generated token)."""
    kept = cache.kept
    if kept == "stats":
        raise ProbeError(
            "this generation cache kept each head's statistics only (keep='stats'), not the rows the "
            "generated tokens read; generate with keep='rows' or {'topk': k} (or whole patterns) for "
            "what each generated token read"
        )
    if isinstance(kept, dict) and "rows" in kept:
        return "rows"
    if isinstance(kept, dict) and "topk" in kept:
        return "topk"
    return "patterns"


def writer_rows(
    cache: Any,
    st: Steps,
    layer: int,
    kind: str = "self",
    steps: list[int] | None = None,
    pattern: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 ``[heads, len(steps), keys]``: the rows that wrote generated tokens ``steps``
    (default all) in ``layer``, NaN where the cache did not keep a weight (see the module).
    ``pattern``: the layer's ``[heads, T, keys]`` pattern of this text already read (whole
    patterns), so that reading a long generation in chunks of steps reads it once."""
    steps = list(range(st.n_steps)) if steps is None else steps
    q = torch.tensor([st.writers[t] for t in steps], dtype=torch.long)
    mode = check_kept(cache)
    b = st.batch
    if mode == "patterns":
        if pattern is None:
            pattern = cache.pattern(st.stack, layer, kind, batch=b)
        return pattern[:, q].double()
    if mode == "rows":
        rows = cache.rows(st.stack, layer, kind, batch=b).double()  # [H, R, K]
        index = cache.row_index(st.stack, layer, kind)[b].tolist()
        where = {int(p): r for r, p in enumerate(index)}
        out = torch.full((rows.shape[0], len(steps), rows.shape[2]), float("nan"), dtype=torch.float64)
        for j, p in enumerate(q.tolist()):
            if p in where:
                out[:, j] = rows[:, where[p]]
        return out
    return _topk_rows(cache, st, layer, kind, q)


def _topk_rows(cache: Any, st: Steps, layer: int, kind: str, q: torch.Tensor) -> torch.Tensor:
    values, indices, mass = cache.topk(st.stack, layer, kind, batch=st.batch)  # [H, T, k], [H, T]
    v, i, m = values[:, q].double(), indices[:, q].long(), mass[:, q].double()
    n_keys = _n_keys(cache, st, kind)
    out = torch.full((v.shape[0], len(q), n_keys), float("nan"), dtype=torch.float64)
    whole = m >= 1 - MASS_TOL
    out[whole] = 0.0  # the row's other weights are below MASS_TOL
    out.scatter_(-1, i, v)
    return out


def _n_keys(cache: Any, st: Steps, kind: str) -> int:
    if kind == "self":
        return st.length
    for k in cache.keys():
        if k.startswith(f"{st.stack}.") and ".cross_attn." in k and k.endswith(("pattern", "rows")):
            return cache.shape(k)[3]
    src = cache.metadata.get("attention_mask") or cache.metadata.get("tokens") or [[]]
    return len(src[st.batch])


def kept_steps(cache: Any, st: Steps, layer: int, kind: str = "self") -> list[int]:
    """The generated tokens whose writing row the cache holds in ``layer`` (every one for whole
    patterns and top-k; the kept rows' for ``keep={"rows": ...}``)."""
    if check_kept(cache) != "rows":
        return list(range(st.n_steps))
    index = {int(p) for p in cache.row_index(st.stack, layer, kind)[st.batch].tolist()}
    return [t for t, p in enumerate(st.writers) if p in index]


__all__ = ["MASS_TOL", "check_kept", "kept_steps", "writer_rows"]
