"""Streaming mean and variance that merge exactly (Chan, Golub & LeVeque 1979/1983).

:class:`RunningStats` keeps, for every element of a tensor-shaped statistic, the count of
observations, their mean and ``M2`` (the sum of squared deviations from the mean). Updating with a
batch and merging two accumulators both use Chan et al.'s parallel formula

    n = n_a + n_b,  δ = mean_b − mean_a,
    mean = mean_a + δ·n_b/n,  M2 = M2_a + M2_b + δ²·n_a·n_b/n,

which is numerically stable (no sum of squares) and exact up to float64 rounding in any merge
order, so shards and ``torchrun`` ranks can be combined in any order. NaN observations are
skipped element by element (a metric undefined for one text does not poison the others), which is
why the count is a tensor too.
"""

from __future__ import annotations

from typing import Any

import torch

from probe.errors import ProbeError


class RunningStats:
    """Count, mean and M2 per element of a statistic of shape ``shape`` (float64).

    ``update(x)`` adds observations ``x`` of shape ``[n, *shape]`` (NaN = missing);
    ``merge(other)`` adds another accumulator's observations; ``mean``, ``var`` (sample variance,
    NaN below two observations), ``std`` and ``count`` are tensors of ``shape``.
    """

    def __init__(self, shape: tuple[int, ...] | None = None) -> None:
        self.shape: tuple[int, ...] | None = None
        self.count = self.mean_ = self.m2 = None
        if shape is not None:
            self._init(tuple(shape))

    def _init(self, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self.count = torch.zeros(shape, dtype=torch.float64)
        self.mean_ = torch.zeros(shape, dtype=torch.float64)
        self.m2 = torch.zeros(shape, dtype=torch.float64)

    def _check(self, shape: tuple[int, ...]) -> None:
        if self.shape is None:
            self._init(shape)
        elif shape != self.shape:
            raise ProbeError(
                f"cannot combine statistics of shape {list(shape)} with {list(self.shape)}; "
                "the caches differ in heads or layers (capture them with the same layers/heads)"
            )

    def update(self, x: torch.Tensor) -> RunningStats:
        """Add the observations ``x[0], x[1], ...`` (shape ``[n, *shape]``); returns self."""
        x = torch.as_tensor(x, dtype=torch.float64)
        if x.dim() == 0:
            x = x.reshape(1)
        self._check(tuple(x.shape[1:]))
        ok = ~torch.isnan(x)
        n = ok.sum(0).to(torch.float64)
        xs = torch.where(ok, x, 0.0)
        mean = xs.sum(0) / n.clamp(min=1)
        m2 = torch.where(ok, (x - mean) ** 2, 0.0).sum(0)
        self._merge(n, mean, m2)
        return self

    def merge(self, other: RunningStats) -> RunningStats:
        """Add ``other``'s observations (exactly: Chan et al.'s parallel formula); returns self."""
        if other.shape is None:
            return self
        self._check(other.shape)
        self._merge(other.count, other.mean_, other.m2)
        return self

    def _merge(self, n_b: torch.Tensor, mean_b: torch.Tensor, m2_b: torch.Tensor) -> None:
        n_a, mean_a = self.count, self.mean_
        n = n_a + n_b
        safe = n.clamp(min=1)
        delta = mean_b - mean_a
        self.mean_ = torch.where(n > 0, mean_a + delta * n_b / safe, 0.0)
        self.m2 = self.m2 + m2_b + delta**2 * n_a * n_b / safe
        self.count = n

    @property
    def mean(self) -> torch.Tensor:
        """Mean per element; NaN where nothing was observed."""
        return torch.where(self.count > 0, self.mean_, float("nan"))

    @property
    def var(self) -> torch.Tensor:
        """Sample variance (divisor n − 1) per element; NaN below two observations."""
        return torch.where(self.count > 1, self.m2 / (self.count - 1).clamp(min=1), float("nan"))

    @property
    def std(self) -> torch.Tensor:
        """Sample standard deviation per element; NaN below two observations."""
        return self.var.sqrt()

    def to_dict(self) -> dict[str, Any]:
        """``{"shape", "count", "mean", "m2"}`` as nested lists (JSON-ready; float64 survives JSON)."""
        if self.shape is None:
            return {"shape": None}
        return {
            "shape": list(self.shape),
            "count": self.count.tolist(),
            "mean": self.mean_.tolist(),
            "m2": self.m2.tolist(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunningStats:
        """The accumulator :meth:`to_dict` described."""
        r = cls()
        if d.get("shape") is None:
            return r
        r._init(tuple(d["shape"]))
        r.count = torch.tensor(d["count"], dtype=torch.float64).reshape(r.shape)
        r.mean_ = torch.tensor(d["mean"], dtype=torch.float64).reshape(r.shape)
        r.m2 = torch.tensor(d["m2"], dtype=torch.float64).reshape(r.shape)
        return r

    def __repr__(self) -> str:
        n = int(self.count.max()) if self.count is not None and self.count.numel() else 0
        return f"<RunningStats shape={self.shape} n≤{n}>"


__all__ = ["RunningStats"]
