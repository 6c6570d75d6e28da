"""Artifact patches: patches that soak up attention and carry outlier residual norms.

Darcet et al. (2024, "Vision Transformers Need Registers") found that large vision transformers
recycle a few background patches as scratch space: from the middle layers on, those patches carry
residual vectors with norms several times their neighbours' and receive a share of attention far
above the rest. :func:`artifacts` lists them from a capture that holds the patterns and the
residual stream (``resid_post``, the default of ``probe.capture``), per layer, text and picture:

* ``received``: the attention a patch j receives against a uniform share, the mean over heads and
  over the real queries i that can see j of ``a_ij · n_i`` (``n_i`` the real keys query i sees):
  1 is what a uniform head would give, 10 is ten times that;
* ``norm``: ``‖resid_post_j‖``, the residual stream leaving the layer at patch j, and
  ``norm_ratio``, that norm over the median norm of the picture's patches at that layer;
* ``artifact``: ``received >= received_min`` and ``norm_ratio >= norm_min`` (defaults 5 and 2:
  the artifacts of DINOv2 in the paper carry norms about three times the median and most of the
  class token's attention in the last layers). Both thresholds are arguments: the rule is the
  paper's description, the numbers are a choice, said in the result.
"""

from __future__ import annotations

from typing import Any

import torch

from probe.analysis.maps import image_stack
from probe.analysis.table import Table
from probe.cache.format import key, token_side
from probe.errors import ProbeError

COLUMNS = [
    "stack",
    "layer",
    "batch",
    "image",
    "pos",
    "row",
    "col",
    "label",
    "received",
    "norm",
    "norm_ratio",
    "artifact",
]


class Artifacts:
    """Artifact patches (see the module docstring): ``table`` holds every patch of every layer,
    text and picture; ``found`` only the artifacts; ``by_layer`` their count per layer."""

    def __init__(self, table: Table, received_min: float, norm_min: float) -> None:
        self.table = table
        self.received_min, self.norm_min = received_min, norm_min
        self.found = Table([r for r in table if r["artifact"]], table.columns, title="artifact patches")
        layers = sorted({(r["stack"], r["layer"]) for r in table})
        self.by_layer = Table(
            [
                {
                    "stack": s,
                    "layer": layer,
                    "patches": sum(1 for r in table if (r["stack"], r["layer"]) == (s, layer)),
                    "artifacts": sum(1 for r in self.found if (r["stack"], r["layer"]) == (s, layer)),
                }
                for s, layer in layers
            ],
            title="artifact patches per layer",
        )

    def positions(self, layer: int, batch: int = 0, image: int = 0) -> list[tuple[int, int]]:
        """The ``(row, col)`` grid positions of the artifacts of ``layer`` in one picture."""
        return [
            (r["row"], r["col"])
            for r in self.found
            if r["layer"] == layer and r["batch"] == batch and r["image"] == image
        ]

    def __repr__(self) -> str:
        rule = f"received >= {self.received_min:g}x uniform and norm >= {self.norm_min:g}x median"
        return (
            f"Artifacts({len(self.found)} of {len(self.table)} patch rows; {rule})\n{self.by_layer.to_text()}"
        )

    def _repr_html_(self) -> str:
        return self.by_layer._repr_html_()


def _grids(pos: dict[str, Any], batch: int) -> list[dict[str, Any]]:
    """The grids of text ``batch``'s pictures (an image model's one grid for every text)."""
    if "rows" in pos:
        return list(pos["rows"][batch]["grids"])
    return [pos["grid"]]


def _received(P: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """``[K]``: per key j, the mean over heads and over the real queries that see j of
    ``a_ij · n_i`` (``P`` ``[heads, Q, K]``, ``real`` ``[K]`` bool; a causal pattern's queries see
    the keys up to their own position, found from the weights being zero above the diagonal)."""
    P = P.double() * real[None, None, :]
    Q, K = P.shape[-2:]
    causal = Q == K and bool((P.triu(1) == 0).all())
    sees = real[None, :] & real[:, None]  # [Q, K]
    if causal:
        sees = sees & torch.ones(Q, K, dtype=torch.bool).tril()
    n = sees.sum(-1).double()  # [Q]
    scaled = (P * n[None, :, None]).mean(0)  # [Q, K]
    counted = sees.double()
    return (scaled * counted).sum(0) / counted.sum(0).clamp(min=1)


def artifacts(
    cache: Any,
    layer: int | None = None,
    *,
    stack: str | None = None,
    received_min: float = 5.0,
    norm_min: float = 2.0,
) -> Artifacts:
    """Find the artifact patches of an image stack (see the module docstring).

    ``layer``: one layer, or None for every layer with a pattern and ``resid_post``. ``stack``:
    the image stack (default: the first with an image grid).
    """
    stack, pos = image_stack(cache, stack)
    layers = [layer] if layer is not None else cache.layer_indices(stack)
    if not layers:
        raise ProbeError(f"the cache holds no layers of the {stack} stack")
    meta = cache.metadata
    # the text's mask pads the stacks over the text; a vision tower's pictures are never padded
    mask = meta.get("attention_mask") if token_side(meta, stack) is not None else None
    rows_out = []
    for li in layers:
        k = key(stack, li, "resid_post")
        if k not in cache:
            raise ProbeError(
                f"the cache holds no residual stream for {stack} layer {li} ({k}); artifact patches "
                "need resid_post: capture with the residual stream (probe.capture's default)"
            )
        resid = cache[k].float()  # [B, T, d]
        for b in range(resid.shape[0]):
            P = cache.pattern(stack, li, batch=b)  # [heads, T, T]
            T = P.shape[-1]
            real = torch.ones(T, dtype=torch.bool)
            if mask is not None and b < len(mask) and len(mask[b]) == T:
                real = torch.tensor(mask[b], dtype=torch.bool)
            got = _received(P, real)
            norms = resid[b].norm(dim=-1).double()
            for g, grid in enumerate(_grids(pos, b)):
                n = grid["rows"] * grid["cols"]
                at = range(grid["offset"], grid["offset"] + n)
                median = float(norms[grid["offset"] : grid["offset"] + n].median())
                for k_, p in enumerate(at):
                    r, c = divmod(k_, grid["cols"])
                    ratio = float(norms[p]) / median if median > 0 else float("nan")
                    rows_out.append(
                        {
                            "stack": stack,
                            "layer": li,
                            "batch": b,
                            "image": g,
                            "pos": p,
                            "row": r,
                            "col": c,
                            "label": f"patch ({r}, {c})",
                            "received": float(got[p]),
                            "norm": float(norms[p]),
                            "norm_ratio": ratio,
                            "artifact": bool(float(got[p]) >= received_min and ratio >= norm_min),
                        }
                    )
    return Artifacts(Table(rows_out, COLUMNS, title="patches"), received_min, norm_min)


__all__ = ["Artifacts", "artifacts"]
