"""The :class:`Cache`: captured patterns and residual tensors, in memory or lazily on disk."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from probe.cache.format import (
    FORMAT_MARKER,
    FORMAT_VERSION,
    KEY_NAMES,
    STACKS,
    key,
    parse_key,
)
from probe.cache.writer import save_tensors
from probe.errors import ProbeError

_STACK_ORDER = {s: i for i, s in enumerate(STACKS)}
_NAME_ORDER = {n: i for i, n in enumerate(KEY_NAMES)}


def _sort_key(k: str) -> tuple:
    try:
        stack, layer, name = parse_key(k)
    except ValueError:
        return (9, 0, 0, k)
    return (_STACK_ORDER[stack], layer, _NAME_ORDER[name], k)


def encode_metadata(meta: Mapping[str, Any]) -> dict[str, str]:
    """The safetensors string metadata for a probe cache with JSON metadata ``meta``."""
    return {
        "format": FORMAT_MARKER,
        "format_version": str(FORMAT_VERSION),
        "probe": json.dumps(meta, ensure_ascii=False),
    }


class Cache(Mapping[str, torch.Tensor]):
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
        self._tensors = dict(tensors or {})
        self._reader = _reader
        self._metadata = dict(metadata or {})
        self.path = Path(path) if path is not None else None
        names = list(self._reader.keys()) if self._reader is not None else list(self._tensors)
        self._keys = sorted(names, key=_sort_key)

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
        except KeyError:
            raise KeyError(f"{k!r} is not in this cache; cache.keys() lists what is") from None

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
            return n * _ITEMSIZE[sl.get_dtype()]
        t = self[k]
        return t.numel() * t.element_size()

    # -- structure -----------------------------------------------------------------------------
    @property
    def metadata(self) -> dict[str, Any]:
        """The JSON metadata: texts, tokens, ids, masks, model, attention implementations, dtype."""
        return self._metadata

    @property
    def stacks(self) -> list[str]:
        """The stacks present, ``encoder`` before ``decoder``."""
        return sorted({parse_key(k)[0] for k in self._keys}, key=_STACK_ORDER.get)

    def n_layers(self, stack: str) -> int:
        """Number of layers captured in ``stack``."""
        return len({parse_key(k)[1] for k in self._keys if parse_key(k)[0] == stack})

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
        head: int | None = None,
        batch: int | None = None,
    ) -> torch.Tensor:
        """The attention pattern of ``layer`` in ``stack``.

        ``kind`` is ``"self"`` or ``"cross"``. Returns ``[batch, head, query, key]``, with the
        ``batch`` and ``head`` dimensions dropped when those are given. On a loaded cache only
        the requested slice is read from disk.
        """
        if kind not in ("self", "cross"):
            raise ValueError(f"kind must be 'self' or 'cross', not {kind!r}")
        k = key(stack, layer, f"{kind}_attn.pattern")
        if k not in self:
            raise KeyError(f"{k!r} is not in this cache; it has stacks {self.stacks}")
        b = slice(None) if batch is None else batch
        h = slice(None) if head is None else head
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
        import base64
        import html
        import io

        esc = html.escape
        meta = self._metadata
        model = meta.get("model") or {}
        params = model.get("parameters")
        rows = [
            (
                "model",
                f"<b>{esc(str(model.get('name', '?')))}</b> <code>{esc(str(model.get('class', '?')))}</code>"
                + (f", {params:,} parameters" if isinstance(params, int) else ""),
            ),
            (
                "stored",
                f"{len(self)} tensors, {esc(str(meta.get('dtype', '?')))}"
                + (f", <code>{esc(str(self.path))}</code>" if self.path else ""),
            ),
        ]
        for s in self.stacks:
            heads = sorted(
                {e.get("self_attn", {}).get("heads") for e in meta.get("layers", []) if e.get("stack") == s}
                - {None}
            )
            rows.append((s, f"{self.n_layers(s)} layers, {', '.join(map(str, heads)) or '?'} heads"))
        tok_style = "border:1px solid #ccc;border-radius:3px;padding:0 3px;margin:1px;white-space:pre"

        def strip(toks: list[str]) -> str:
            shown = "".join(f'<span style="{tok_style}">{esc(t)}</span>' for t in toks[:64])
            return shown + (f" … ({len(toks)} tokens)" if len(toks) > 64 else "")

        for i, toks in enumerate(self.tokens[:4]):
            rows.append((f"text {i}", strip(toks)))
            if self.target_tokens:
                rows.append(("target", strip(self.target_tokens[i])))
        img = ""
        first = next((k for k in self._keys if k.endswith("attn.pattern")), None)
        if first is not None:
            import matplotlib.image
            import torch.nn.functional as F

            p = self[first][0, 0].float()
            n = len(self.tokens[0]) if self.tokens and p.shape[0] == p.shape[1] else None
            p = p[:n, :n] if n else p
            p = F.adaptive_max_pool2d(p[None, None], (min(p.shape[0], 96), min(p.shape[1], 96)))[0, 0]
            buf = io.BytesIO()
            matplotlib.image.imsave(buf, p.clamp(0, 1).numpy(), cmap="viridis", vmin=0, vmax=1, format="png")
            uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
            img = (
                f'<figure style="margin:0 0 0 1em"><img src="{uri}" alt="attention pattern" '
                f'style="width:128px;image-rendering:pixelated;border:1px solid #ccc">'
                f'<figcaption style="font-size:11px">{esc(first)}, head 0</figcaption></figure>'
            )
        body = "".join(
            f'<tr><th style="text-align:left;padding-right:1em">{esc(k)}</th>'
            f'<td style="text-align:left">{v}</td></tr>'
            for k, v in rows
        )
        return (
            f'<div style="display:flex;align-items:flex-start"><table><caption style="text-align:left">'
            f"probe.Cache</caption>{body}</table>{img}</div>"
        )

    def __repr__(self) -> str:
        where = f" at {self.path}" if self.path else ""
        model = self._metadata.get("model", {}).get("name", "?")
        return f"<probe.Cache model={model!r} keys={len(self)}{where}>"


_ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}


def _read_header(path: Path) -> dict:
    size = path.stat().st_size
    name = path.name
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ProbeError(
                f"{name} is not a safetensors file (only {size} bytes); "
                "give a cache written by `probe capture`"
            )
        (n,) = struct.unpack("<Q", head)
        if n > 100_000_000:
            raise ProbeError(
                f"{name} is not a safetensors file (bad header length); "
                "give a cache written by `probe capture`"
            )
        if 8 + n > size:
            raise ProbeError(
                f"{name} is truncated (header needs {8 + n} bytes, file has {size}); capture it again"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError
    except (UnicodeDecodeError, ValueError):
        raise ProbeError(
            f"{name} is not a safetensors file (its header is not JSON); "
            "give a cache written by `probe capture`"
        ) from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise ProbeError(f"{name} is truncated ({size} of {8 + n + end} bytes); capture it again")
    return header


def load(path: str | os.PathLike) -> Cache:
    """Open a probe cache lazily (memory-mapped): tensors are read only when accessed.

    Raises :class:`ProbeError` for a missing file, a file that is not safetensors, a truncated
    file, a safetensors file that is not a probe cache, or a cache from a newer probe.
    """
    path = Path(path)
    if not path.exists():
        raise ProbeError(f"no such file: {path}; give the path of a cache written by `probe capture`")
    if path.is_dir():
        raise ProbeError(f"{path} is a directory; give the path of a .safetensors cache file")
    header = _read_header(path)
    meta = header.get("__metadata__") or {}
    if meta.get("format") != FORMAT_MARKER:
        raise ProbeError(
            f"{path.name} is a safetensors file but not a probe cache "
            "(no probe metadata); make one with `probe capture`"
        )
    try:
        version = int(meta.get("format_version", "0"))
    except ValueError:
        raise ProbeError(
            f"{path.name} has an unreadable format version {meta.get('format_version')!r}; capture it again"
        ) from None
    if version > FORMAT_VERSION:
        raise ProbeError(
            f"{path.name} uses cache format {version}, newer than this probe reads "
            f"({FORMAT_VERSION}); upgrade probe"
        )
    try:
        metadata = json.loads(meta.get("probe", "{}"))
    except ValueError:
        raise ProbeError(f"{path.name} has corrupt probe metadata; capture it again") from None
    try:
        reader = safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own error types
        raise ProbeError(f"{path.name} is not a valid safetensors file ({e}); capture it again") from None
    return Cache(metadata=metadata, path=path, _reader=reader)
