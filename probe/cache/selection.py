"""Which layers and heads a capture or a corpus run keeps: one value, validated in one place.

:class:`Selection` is parsed from what the user gave (``probe.capture(layers=, heads=)`` or a
corpus run's ``keep={"layers": ..., "heads": ...}``) and checked against the counts a model or
a cache has, so that probe never stores less than was asked for without saying so. Each refusal
is one line naming the selection the way the user wrote it and the indices that exist.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

from probe.cache.cache import Cache
from probe.cache.format import parse_key
from probe.errors import ProbeError

_PATTERN = ".pattern"  # the pattern of any attention: self_attn.pattern, cross_attn.1.pattern


def _indices(values: Any, what: str, one: str) -> list[int] | None:
    """``layers=``/``heads=``: None (all) or a non-empty list of distinct non-negative indices."""
    if values is None:
        return None
    if isinstance(values, int) and not isinstance(values, bool):
        values = [values]
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ProbeError(f"{what} must be a list of {one} indices like [0, 2], not {values!r}")
    raw = list(values)
    if not raw:
        raise ProbeError(f"{what}=[] selects no {one}; give indices like [0, 2], or None for all")
    values = []
    for v in raw:
        try:
            i = -1 if isinstance(v, bool) else operator.index(v)
        except TypeError:
            i = -1
        if i < 0:
            raise ProbeError(f"{what} must be non-negative {one} indices like [0, 2]; {v!r} is not one")
        values.append(i)
    if len(set(values)) != len(values):
        raise ProbeError(f"{what}={values} names a {one} twice; give each index once")
    return values


def _keep_indices(keep: dict, what: str) -> list[int] | None:
    """``keep[what]``: None (all) or a non-empty list of non-negative integers, sorted, each once."""
    v = keep.get(what)
    if v is None:
        return None
    if not isinstance(v, (list, tuple)) or not all(isinstance(i, int) and i >= 0 for i in v):
        raise ProbeError(f"keep[{what!r}] should be a list of non-negative integers, not {v!r}")
    if not v:  # as capture(layers=[]): an empty selection is a mistake, not "keep nothing"
        raise ProbeError(
            f"keep[{what!r}]=[] selects no {what[:-1]}; give indices like [0, 2], or None for all"
        )
    return sorted(set(v))


@dataclass(frozen=True)
class Selection:
    """Layer and head indices to keep (None: all), and how refusals name them.

    ``layers`` index a stack's layers, ``heads`` the heads of every attention pattern.
    ``keep``: the selection came from a corpus run's ``keep=`` (messages say ``keep layers [..]``)
    rather than from ``layers=``/``heads=`` (messages say ``layers=[..]``).
    """

    layers: list[int] | None = None
    heads: list[int] | None = None
    keep: bool = False

    @classmethod
    def parse(cls, layers: Any = None, heads: Any = None) -> Selection:
        """The selection of ``probe.capture(layers=, heads=)``; a one-line :class:`ProbeError`
        for anything but None or distinct non-negative indices."""
        return cls(_indices(layers, "layers", "layer"), _indices(heads, "heads", "head"))

    @classmethod
    def from_keep(cls, keep: dict) -> Selection:
        """The selection of a corpus run's ``keep={"layers": [...], "heads": [...]}`` (either may be
        None or absent); indices sorted, each once."""
        return cls(_keep_indices(keep, "layers"), _keep_indices(keep, "heads"), keep=True)

    def _named(self, what: str) -> str:
        values = self.layers if what == "layers" else self.heads
        return f"keep {what} {values}" if self.keep else f"{what}={values}"

    def wants_layer(self, index: int) -> bool:
        """Whether layer ``index`` (its index in its list) is selected."""
        return self.layers is None or index in self.layers

    def check_heads(self, n_heads: int) -> None:
        """Refuse head indices an attention pattern with ``n_heads`` heads does not have."""
        if self.heads is not None and max(self.heads) >= n_heads:
            raise ProbeError(
                f"{self._named('heads')}: this model's attention has {n_heads} heads; "
                f"choose indices from 0-{n_heads - 1}"
            )

    def check_layers(self, counts: list[int], found: bool = True) -> None:
        """Refuse layer indices past every stack (``counts``: each stack's number of layers), or a
        selection that ``found`` no layer to record: never record less than was asked for."""
        most = max(counts)
        missing = [i for i in self.layers or [] if i >= most]
        if missing or not found:
            what = "selects no layer" if not found else f"names layers {missing} that do not exist"
            have = " and ".join(f"{n}" for n in counts)
            raise ProbeError(
                f"{self._named('layers')} {what} (the model has {have} layers); "
                f"choose indices from 0-{most - 1}"
            )

    def check_cache(self, cache: Cache) -> None:
        """:meth:`check_layers` and :meth:`check_heads` against the patterns ``cache`` holds
        (nothing to check in a cache without patterns)."""
        patterns = [k for k in cache.keys() if k.endswith(_PATTERN)]
        if not patterns:
            return
        self.check_layers([1 + max(parse_key(k)[1] for k in patterns)])
        self.check_heads(min(cache.shape(k)[1] for k in patterns))

    def patterns(self, cache: Cache) -> Cache:
        """The selected patterns of ``cache`` (heads cut, residuals left out), checked first; the
        metadata records the selection (``layers_captured``, ``heads_captured``)."""
        self.check_cache(cache)
        tensors = {}
        for k in cache.keys():
            if not k.endswith(_PATTERN) or not self.wants_layer(parse_key(k)[1]):
                continue
            t = cache[k]
            tensors[k] = t if self.heads is None else t[:, self.heads].contiguous()
        meta = dict(cache.metadata)
        meta["layers_captured"] = self.layers
        meta["heads_captured"] = self.heads
        return Cache(tensors, meta)
