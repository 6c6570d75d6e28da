"""The :class:`Cache`: captured patterns and residual tensors, in memory or lazily on disk."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from probe.cache.format import (
    FORMAT_MARKER,
    FORMAT_VERSION,
    KEY_NAMES,
    PATTERN_BY,
    STACKS,
    attention_name,
    key,
    parse_key,
    parse_name,
)
from probe.cache.kept import KeptFields
from probe.cache.perf.heap import HeapTensors
from probe.cache.queries import CacheKeyError, CacheQueries
from probe.cache.validate import ITEMSIZE, check_consistency, check_header, check_metadata, read_header
from probe.cache.writer import save_tensors
from probe.errors import ProbeError

_STACK_ORDER = {s: i for i, s in enumerate(STACKS)}
_NAME_ORDER = {n: i for i, n in enumerate(KEY_NAMES)}


def _parsed(k: str) -> tuple[str, int, str] | None:
    try:
        return parse_key(k)
    except ValueError:
        return None


def _name_order(name: str) -> tuple:
    # version 1 names in their order; then the other fields of each attention, grouped by attention
    if name in _NAME_ORDER:
        return (_NAME_ORDER[name], -1, "")
    n = parse_name(name)
    group = _NAME_ORDER.get(f"{n.role}_attn.pattern", len(_NAME_ORDER)) if n.role else len(_NAME_ORDER)
    return (group, -1 if n.index is None else n.index, name)


def _stack_order(meta: Mapping[str, Any]) -> dict[str, int]:
    """Stacks in the order the metadata lists them (the order the model ran them), else encoder first."""
    listed = meta.get("stacks")
    order = dict(_STACK_ORDER)
    if isinstance(listed, dict):
        names = list(listed)
        if not set(names) <= set(STACKS):
            order = {s: i for i, s in enumerate(names)}
    return order


def _sort_key(k: str, order: Mapping[str, int] = _STACK_ORDER) -> tuple:
    try:
        stack, layer, name = parse_key(k)
    except ValueError:
        return (9, "", 0, (), k)
    return (order.get(stack, len(order)), stack, layer, _name_order(name), k)


def encode_metadata(meta: Mapping[str, Any]) -> dict[str, str]:
    """The safetensors string metadata for a probe cache with JSON metadata ``meta``."""
    return {
        "format": FORMAT_MARKER,
        "format_version": str(FORMAT_VERSION),
        "probe": json.dumps(meta, ensure_ascii=False),
    }


class Cache(CacheQueries, KeptFields, Mapping[str, torch.Tensor]):
    """Captured attention patterns and residual-stream tensors of one forward pass.

    Keys are ``<stack>.blocks.<i>.<name>`` (see :mod:`probe.cache.format`). A cache made by
    :func:`probe.capture` lives in memory; one opened with :func:`probe.load` reads tensors from
    the memory-mapped file only when asked for them.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        metadata: Mapping[str, Any] | None = None,
        *,
        path: str | os.PathLike | None = None,
        _reader: Any = None,
    ) -> None:
        # dropped, it hands the freed heap back to the system (RSS falls at `del cache`)
        self._tensors = HeapTensors(tensors or {})
        self._reader = _reader
        self._metadata = dict(metadata or {})
        self.path = Path(path) if path is not None else None
        names = list(self._reader.keys()) if self._reader is not None else list(self._tensors)
        self._stack_order = _stack_order(self._metadata)
        self._keys = sorted(names, key=lambda k: _sort_key(k, self._stack_order))

    # -- mapping -------------------------------------------------------------------------------
    def keys(self) -> list[str]:  # type: ignore[override]
        """All tensor keys, ordered by stack, layer and name."""
        return list(self._keys)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, k: object) -> bool:
        return k in set(self._keys)

    def __getitem__(self, k: str) -> torch.Tensor:
        if k not in self._tensors and self._reader is not None and k in self._keys:
            return self._reader.get_tensor(k)
        try:
            return self._tensors[k]
        except (KeyError, TypeError):
            raise CacheKeyError(f"{k!r} is not in this cache; cache.keys() lists what is") from None

    def shape(self, k: str) -> tuple[int, ...]:
        """The shape of tensor ``k`` without reading its data."""
        if self._reader is not None:
            return tuple(self._reader.get_slice(k).get_shape())
        return tuple(self[k].shape)

    def nbytes(self, k: str) -> int:
        """The size in bytes of tensor ``k``."""
        if self._reader is not None:
            sl = self._reader.get_slice(k)
            n = 1
            for d in sl.get_shape():
                n *= d
            return n * ITEMSIZE[sl.get_dtype()]
        t = self[k]
        return t.numel() * t.element_size()

    # -- structure -----------------------------------------------------------------------------
    @property
    def metadata(self) -> dict[str, Any]:
        """The JSON metadata: texts, tokens, ids, masks, model, attention implementations, dtype."""
        return self._metadata

    @property
    def stacks(self) -> list[str]:
        """The stacks present: ``encoder`` before ``decoder``, others in the order the model ran them."""
        found = {p[0] for p in map(_parsed, self._keys) if p is not None}
        return sorted(found, key=lambda s: (self._stack_order.get(s, len(self._stack_order)), s))

    def attentions(self, stack: str, layer: int) -> list[tuple[str, int | None]]:
        """The attentions of ``layer`` in ``stack`` that have a stored pattern, as ``(kind, index)``:
        ``[("self", None), ("cross", None)]`` for a usual decoder layer; ``index`` numbers the
        attentions of one kind when a layer computes several (``[("self", 0), ("self", 1)]``)."""
        found = []
        for k in self._keys:
            p = _parsed(k)
            if p is None or p[0] != stack or p[1] != layer:
                continue
            n = parse_name(p[2])
            if n.field == "pattern":
                found.append((n.role, n.index))
        return found

    def layer_indices(self, stack: str, name: str | None = None) -> list[int]:
        """The layer indices captured in ``stack`` (holding key ``name`` when given), ascending."""
        found = {p[1] for p in map(_parsed, self._keys) if p and p[0] == stack and name in (None, p[2])}
        return sorted(found)

    def n_layers(self, stack: str) -> int:
        """Number of layers captured in ``stack``."""
        return len(self.layer_indices(stack))

    @property
    def tokens(self) -> list[list[str]]:
        """The input tokens per text, as a person reads them (the encoder side for encoder-decoders)."""
        return self._metadata.get("tokens", [])

    @property
    def target_tokens(self) -> list[list[str]] | None:
        """The decoder tokens per text for encoder-decoders, else None."""
        return self._metadata.get("target_tokens")

    def pattern(
        self,
        stack: str = "decoder",
        layer: int = 0,
        kind: str = "self",
        *,
        head: int | slice | None = None,
        batch: int | slice | None = None,
        index: int | None = None,
        by: str = "weight",
    ) -> torch.Tensor:
        """The attention pattern of ``layer`` in ``stack``.

        ``kind`` is ``"self"`` or ``"cross"``; ``index`` picks one of several attentions of that
        kind in the layer (see :meth:`attentions`). Returns ``[batch, head, query, key]``, with the
        ``batch`` and ``head`` dimensions dropped when those are given as integers (a slice, such
        as ``head=slice(0, 4)``, keeps the dimension). On a loaded cache only the requested slice
        is read from disk. ``by="contribution"``: instead of the weights, the norm of what each head
        writes from each key, ``||a_ij v_j W_O^h||`` (Kobayashi et al. 2020), in a cache that
        ``probe.contributions`` captured (rows do not sum to 1; divide by their sum to compare).
        """
        if kind not in ("self", "cross"):
            raise ProbeError(f"kind must be 'self' or 'cross', not {kind!r}")
        if by not in PATTERN_BY:
            raise ProbeError(f"by must be one of {', '.join(map(repr, PATTERN_BY))}, not {by!r}")
        if stack not in self.stacks:
            raise CacheKeyError(
                f"no {stack!r} stack in this cache; it has {', '.join(self.stacks) or 'no layers'}"
            )
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ProbeError(f"layer must be an integer index, not {layer!r}")
        if index is not None and (isinstance(index, bool) or not isinstance(index, int) or index < 0):
            raise ProbeError(f"index must be a non-negative integer, not {index!r}")
        name = attention_name(kind, PATTERN_BY[by], index)
        if layer < 0:  # not an index from the end: a layer's number is its depth
            have = ranges_text(self.layer_indices(stack, name)) or "none"
            raise ProbeError(
                f"layer={layer}: layers count from 0; the {stack} has {kind}-attention layers {have}"
            )
        k = key(stack, layer, name)
        if k not in self and by != "weight" and not any(x.endswith(f".{PATTERN_BY[by]}") for x in self._keys):
            raise CacheKeyError(
                f"this cache holds no {by}s; capture them with probe.contributions(model, inputs)"
            )
        if k not in self:
            if self.partial:
                raise self.not_kept()
            several = sorted(i for r, i in self.attentions(stack, layer) if r == kind and i is not None)
            if several and index is None:
                raise CacheKeyError(
                    f"layer {layer} of the {stack} computes {len(several)} {kind}-attentions; "
                    f"choose one with index= (0-{several[-1]})"
                )
            have = self.layer_indices(stack, name)
            where = f"layers {ranges_text(have)}" if have else "no layer"
            raise CacheKeyError(
                f"{k!r} is not in this cache: the {stack} has {kind}-attention patterns for {where}; "
                "choose one of those"
            )
        n_batch, n_head = self.shape(k)[:2]
        note = ""
        if self._metadata.get("heads_captured") is not None:
            note = f" (index i is the i-th of the captured heads {self._metadata['heads_captured']})"
        b = slice(None) if batch is None else _index(batch, n_batch, "batch", "texts", k)
        h = slice(None) if head is None else _index(head, n_head, "head", "heads", k, note)
        if self._reader is not None and k not in self._tensors:
            return self._reader.get_slice(k)[b, h]
        return self[k][b, h]

    # -- disk ----------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write the cache to ``path`` as safetensors, atomically (temporary file, then rename)."""
        tensors = {k: self[k] for k in self._keys}
        return save_tensors(path, tensors, encode_metadata(self._metadata))

    def _repr_html_(self) -> str:
        """A static summary for notebooks: model, per-stack layers and heads, the tokens, and a
        thumbnail of the first pattern (inline PNG). No scripts, no network: the same in Jupyter,
        JupyterLab and VS Code. Every string from the model or the user is escaped."""
        from probe.cache.display import repr_html

        return repr_html(self)

    def __repr__(self) -> str:
        where = f" at {self.path}" if self.path else ""
        model = self._metadata.get("model")
        model = model.get("name", "?") if isinstance(model, dict) else "?"
        return f"<probe.Cache model={model!r} keys={len(self)}{where}>"


def ranges_text(xs: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for x in sorted(set(xs)):
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _index(value: Any, n: int, what: str, unit: str, k: str, note: str = "") -> int | slice:
    if isinstance(value, slice):  # a block of heads or texts, read lazily in one go
        if value.step not in (None, 1):
            raise ProbeError(f"{what} slices must have step 1, not {value.step!r}")
        start, stop, _ = value.indices(n)
        if start >= stop:
            raise ProbeError(f"{what}={value} selects nothing: {k} has {n} {unit}")
        return slice(start, stop)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProbeError(f"{what} must be an integer index or a slice, not {value!r}")
    if not -n <= value < n:
        valid = f"choose 0-{n - 1}" if n else "it holds none"
        raise ProbeError(f"{what}={value} is out of range: {k} has {n} {unit}; {valid}{note}")
    return value


def load(path: str | os.PathLike) -> Cache:
    """Open a probe cache lazily (memory-mapped): tensors are read only when accessed.

    The header and metadata are validated first (structure, types, keys, shapes against the
    tokens and layer counts) without reading tensor data. Raises :class:`ProbeError`, naming the
    file, the problem and the fix, for anything that is not a readable probe cache: a missing or
    unreadable path, a directory or pipe, a file that is not safetensors, a truncated or
    malformed one, a safetensors file that is not a probe cache, or a cache from a newer probe.
    """
    return open_cache(path)


def open_cache(path: str | os.PathLike, *, shown: str | os.PathLike | None = None) -> Cache:
    """:func:`load` the file at ``path``; messages and ``Cache.path`` name ``shown`` (default: ``path``).

    The writer opens its temporary file this way before renaming it to ``shown``, so the Cache
    it returns is the data it wrote even if another process replaces ``shown`` right after.
    """
    path = Path(path)
    shown = Path(shown) if shown is not None else path
    name = str(shown)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then refuses it
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise ProbeError(
            f"no such file: {name}; give the path of a cache written by `probe capture`"
        ) from None
    except OSError as e:
        raise ProbeError(
            f"{name}: cannot open it ({e.strerror}); check the path and its permissions"
        ) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ProbeError(f"{name} is a directory; give the path of a .safetensors cache file")
        raise ProbeError(f"{name} is not a regular file (a pipe or device); give a .safetensors cache file")
    with os.fdopen(fd, "rb") as f:
        try:
            header, n = read_header(f, name, st.st_size)
        except OSError as e:
            raise ProbeError(f"{name}: cannot read it ({e.strerror}); check the file") from None
    strings, shapes = check_header(header, name, st.st_size - 8 - n)
    metadata = check_metadata(strings["probe"], name)
    check_consistency(shapes, metadata, name)
    try:
        reader = safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own error types
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ProbeError(f"{name}: not a valid safetensors file ({msg}); capture it again") from None
    if reader.metadata() != strings or set(reader.keys()) != set(shapes):
        raise ProbeError(
            f"{name} changed while it was being opened (another process wrote it); open it again"
        )
    return Cache(metadata=metadata, path=shown, _reader=_Guarded(reader, path, st.st_size, name))


class _Guarded:
    """A lazily read file's reader that first checks the file still has its size: safetensors
    maps the file into memory, and reading a mapped page past the end of a file truncated since
    (another process rewrote it in place) kills the process with SIGBUS instead of an error."""

    def __init__(self, reader: Any, path: Path, size: int, name: str) -> None:
        self._reader, self._size, self._name = reader, size, name
        self._fd = os.open(path, os.O_RDONLY)  # the file that was mapped, even if renamed over

    def __del__(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            os.close(fd)

    def _check(self) -> None:
        now = os.fstat(self._fd).st_size
        if now < self._size:
            raise ProbeError(
                f"{self._name} was truncated after it was opened ({now} of {self._size} bytes "
                "left); its data cannot be read; capture it again or restore the file, then load it"
            )

    def keys(self) -> list[str]:
        return self._reader.keys()

    def metadata(self) -> dict[str, str]:
        return self._reader.metadata()

    def get_tensor(self, k: str) -> torch.Tensor:
        self._check()
        return self._reader.get_tensor(k)

    def get_slice(self, k: str) -> Any:
        self._check()
        return self._reader.get_slice(k)
