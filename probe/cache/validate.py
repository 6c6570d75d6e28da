"""One validation layer for cache files: every structural or type problem is a :class:`ProbeError`.

:func:`read_header` parses the safetensors header from an open file; :func:`check_header` checks
the header's structure (string metadata, tensor entries, offsets within the file);
:func:`check_metadata` checks the types of the probe metadata fields a reader relies on (unknown
extra fields are accepted, so newer writers stay readable); :func:`check_consistency` checks the
tensor keys and shapes against the metadata (batch size and token counts, layer indices against
the layer counts). Nothing here reads tensor data, so opening a multi-GB cache stays fast.

Every message names the file, what is wrong and what to do.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from typing import IO, Any

from probe.cache.format import FORMAT_MARKER, FORMAT_VERSION, is_stack_name, parse_key, parse_name, token_side
from probe.cache.pictures import picture_count
from probe.errors import ProbeError

ITEMSIZE = {
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
MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header
MAX_DEPTH = 64  # deeper metadata is not something probe writes (and could exhaust the stack)
MAX_LAYERS = 1_000_000
AGAIN = "capture it again"
NOT_CACHE = "give a cache written by `probe capture`"


def _fail(name: str, problem: str, fix: str = AGAIN) -> ProbeError:
    return ProbeError(f"{name}: {problem}; {fix}")


def _json(raw: bytes | str, name: str, what: str, fix: str) -> Any:
    try:
        return json.loads(raw)
    except RecursionError:
        raise _fail(name, f"{what} is nested too deeply", fix) from None
    except (UnicodeDecodeError, ValueError):
        raise _fail(name, f"{what} is not valid JSON", fix) from None


def read_header(f: IO[bytes], name: str, size: int) -> tuple[dict, int]:
    """The parsed JSON header of the safetensors file open as ``f`` (``size`` bytes) and its length."""
    head = f.read(8)
    if len(head) < 8:
        raise _fail(name, f"not a probe cache: not a safetensors file (only {size} bytes)", NOT_CACHE)
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER or n < 2:
        # a safetensors file starts with its header's length; these 8 bytes cannot be one
        raise _fail(name, f"not a probe cache: not a safetensors file ({_looks_like(head)})", NOT_CACHE)
    if 8 + n > size:
        raise _fail(name, f"truncated (header needs {8 + n} bytes, file has {size})")
    raw = f.read(n)
    if len(raw) < n:
        raise _fail(name, f"truncated while reading (header needs {8 + n} bytes)")
    header = _json(raw, name, "the safetensors header", NOT_CACHE)
    if not isinstance(header, dict):
        raise _fail(name, "not a safetensors file (its header is not a JSON object)", NOT_CACHE)
    return header, n


def _looks_like(head: bytes) -> str:
    """What a file's first bytes suggest, for an error message."""
    if head.startswith(b"PK\x03\x04"):
        return "it is a zip archive, e.g. a torch.save .pt or .bin file"
    if head.startswith(b"\x80"):
        return "it looks like a pickle"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return "it does not start with a safetensors header"
    if all(c.isprintable() or c in "\t\r\n" for c in text):
        return "it looks like a text file"
    return "it does not start with a safetensors header"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_header(header: dict, name: str, data_size: int) -> tuple[dict[str, str], dict[str, tuple]]:
    """Check a safetensors header; returns its string metadata and ``{key: shape}``.

    ``data_size`` is the number of bytes after the header: every tensor must lie within it.
    """
    meta = header.get("__metadata__")
    if meta is None:
        raise _fail(name, "a safetensors file but not a probe cache (no probe metadata)", NOT_CACHE)
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _fail(name, "its __metadata__ is not a map of strings (not a probe cache)", NOT_CACHE)
    if meta.get("format") != FORMAT_MARKER:
        raise _fail(name, "a safetensors file but not a probe cache (no probe metadata)", NOT_CACHE)
    raw_version = meta.get("format_version")
    if raw_version is None or not (raw_version.isascii() and raw_version.isdigit()):
        raise _fail(name, f"unreadable cache format version {raw_version!r}")
    version = int(raw_version)
    if version > FORMAT_VERSION:
        raise _fail(
            name,
            f"uses cache format {version}, newer than this probe reads ({FORMAT_VERSION})",
            "upgrade probe",
        )
    if version < 1:
        raise _fail(name, f"unreadable cache format version {raw_version!r}")
    if "probe" not in meta:
        raise _fail(name, "no probe metadata (the 'probe' field is missing)")
    shapes: dict[str, tuple] = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        try:
            parse_key(k)
        except ValueError:
            raise _fail(name, f"tensor {k[:60]!r} is not a probe cache key", NOT_CACHE) from None
        shapes[k] = _check_entry(k, v, name, data_size)
    return meta, shapes


def _check_entry(k: str, v: Any, name: str, data_size: int) -> tuple:
    if not isinstance(v, dict):
        raise _fail(name, f"tensor {k} has a malformed entry (not an object)")
    dtype, shape, offsets = v.get("dtype"), v.get("shape"), v.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise _fail(name, f"tensor {k} has an unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _fail(name, f"tensor {k} has a malformed shape {str(shape)[:40]}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise _fail(name, f"tensor {k} has malformed data_offsets {str(offsets)[:40]}")
    n = ITEMSIZE[dtype]
    for d in shape:
        n *= d
    if offsets[1] - offsets[0] != n:
        raise _fail(name, f"tensor {k}: its offsets span {offsets[1] - offsets[0]} bytes, its shape {n}")
    if offsets[1] > data_size:
        raise _fail(name, f"truncated (tensor {k} ends at byte {offsets[1]}, the data has {data_size})")
    return tuple(shape)


# -- the probe metadata ------------------------------------------------------------------------


def _depth(obj: Any) -> int:
    deepest, todo = 0, [(obj, 1)]
    while todo:
        o, d = todo.pop()
        deepest = max(deepest, d)
        if d > MAX_DEPTH:
            return d
        if isinstance(o, dict):
            todo.extend((v, d + 1) for v in o.values())
        elif isinstance(o, list):
            todo.extend((v, d + 1) for v in o)
    return deepest


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def _int_or_bool(v: Any) -> bool:
    return isinstance(v, int)


_ROWS_STR = _list_of(_list_of(_str))
_ROWS_INT = _list_of(_list_of(_int_or_bool))
_INTS = _list_of(_is_int)
_OPT_INTS = lambda v: v is None or _INTS(v)  # noqa: E731

# the fields a reader relies on, with the type each must have when present
_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "texts": (_list_of(_str), "a list of strings"),
    "target_texts": (_list_of(_str), "a list of strings"),
    "tokens": (_ROWS_STR, "a list of lists of strings"),
    "target_tokens": (lambda v: v is None or _ROWS_STR(v), "a list of lists of strings"),
    "ids": (_ROWS_INT, "a list of lists of integers"),
    "target_ids": (_ROWS_INT, "a list of lists of integers"),
    "attention_mask": (_ROWS_INT, "a list of lists of integers"),
    "target_attention_mask": (_ROWS_INT, "a list of lists of integers"),
    "special_tokens_mask": (_ROWS_INT, "a list of lists of integers"),
    "target_special_tokens_mask": (_ROWS_INT, "a list of lists of integers"),
    "model": (lambda v: isinstance(v, dict), "an object"),
    "attention_implementations": (_list_of(_str), "a list of strings"),
    "dtype": (_str, "a string"),
    "stacks": (lambda v: isinstance(v, dict), "an object"),
    "layers": (_list_of(lambda e: isinstance(e, dict)), "a list of objects"),
    "layers_captured": (_OPT_INTS, "a list of integers or null"),
    "heads_captured": (_OPT_INTS, "a list of integers or null"),
    "probe_version": (_str, "a string"),
    "format_version": (_is_int, "an integer"),
    "input_kind": (_str, "a string"),
    "input_shape": (_INTS, "a list of integers"),
    "padding_side": (_str, "a string"),
}
_STACK_FIELDS = {
    "module": (_str, "a string"),
    "tokens": (lambda v: v in ("source", "target", None), '"source", "target" or null'),
    "chain": (lambda v: isinstance(v, bool), "true or false"),
}
_MODEL_FIELDS = {
    "name": (_str, "a string"),
    "class": (_str, "a string"),
    "parameters": (_is_int, "an integer"),
    "config": (lambda v: v is None or isinstance(v, dict), "an object or null"),
}


def _attention_entries(entry: dict) -> list[str]:
    """The keys of a ``layers[i]`` entry that describe an attention: ``self_attn``, ``cross_attn.1``, ..."""
    found = []
    for k in entry:
        role, _, n = k.partition(".")
        if role in ("self_attn", "cross_attn") and (not n or n.isdigit()):
            found.append(k)
    return found


def _check_fields(obj: dict, fields: dict, name: str, where: str) -> None:
    for field, (ok, what) in fields.items():
        if field in obj and not ok(obj[field]):
            raise _fail(name, f"metadata field {where}{field} should be {what}, not {_kind(obj[field])}")


def _kind(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def check_metadata(raw: str, name: str) -> dict[str, Any]:
    """Parse the probe metadata (a JSON object in a string) and check the fields probe relies on."""
    meta = _json(raw, name, "the probe metadata", AGAIN)
    if not isinstance(meta, dict):
        raise _fail(name, f"the probe metadata is a JSON {_kind(meta)}, not an object")
    if _depth(meta) > MAX_DEPTH:
        raise _fail(name, f"the probe metadata is nested more than {MAX_DEPTH} levels deep")
    _check_fields(meta, _FIELDS, name, "")
    _check_fields(meta.get("model", {}), _MODEL_FIELDS, name, "model.")
    for s, v in meta.get("stacks", {}).items():
        if not is_stack_name(s) or not isinstance(v, dict) or not _is_int(v.get("layers")) or v["layers"] < 0:
            raise _fail(name, f"metadata field stacks.{s[:20]} is malformed (expected {{'layers': count}})")
        _check_fields(v, _STACK_FIELDS, name, f"stacks.{s[:20]}.")
    for i, e in enumerate(meta.get("layers", [])):
        listed = meta.get("stacks")
        if (
            not is_stack_name(e.get("stack"))
            or isinstance(listed, dict)
            and e["stack"] not in listed
            or not _is_int(e.get("layer"))
            or not 0 <= e["layer"] < MAX_LAYERS
        ):
            raise _fail(name, f"metadata field layers[{i}] has no valid stack and layer index")
        if "module" in e and not isinstance(e["module"], str):
            raise _fail(name, f"metadata field layers[{i}].module should be a string")
        if "call" in e and not (_is_int(e["call"]) and e["call"] >= 0):
            raise _fail(name, f"metadata field layers[{i}].call should be a call index (an integer >= 0)")
        for role in _attention_entries(e):
            a = e.get(role)
            impl = a.get("impl") if isinstance(a, dict) else None
            if (
                not isinstance(a, dict)
                or not _is_int(a.get("heads"))
                or not (impl is None or _str(impl) or _list_of(_str)(impl))
            ):
                raise _fail(name, f"metadata field layers[{i}].{role} is malformed")
    return meta


# -- keys and shapes against the metadata ------------------------------------------------------


def _length(rows: list[list]) -> int:
    return max((len(r) for r in rows), default=0)


def check_consistency(shapes: Mapping[str, tuple], meta: dict[str, Any], name: str) -> None:
    """Check tensor shapes against the metadata: ranks, batch size, token counts, layer indices."""
    target = meta.get("target_tokens")
    stacks = meta.get("stacks")
    _check_rows(meta, "", name)
    if target is not None:
        _check_rows(meta, "target_", name)
    for k, shape in shapes.items():
        stack, layer, what = parse_key(k)
        if stacks is not None:
            if stack not in stacks:
                raise _fail(name, f"tensor {k} is in stack {stack!r}, which the metadata does not list")
            if layer >= stacks[stack]["layers"]:
                raise _fail(
                    name, f"tensor {k}: layer {layer}, but the {stack} has {stacks[stack]['layers']} layers"
                )
        elif layer >= MAX_LAYERS:
            raise _fail(name, f"tensor {k}: layer index {layer} is not plausible")
        _check_shape(k, shape, parse_name(what), token_side(meta, stack), meta, name)


_SIDES = {"source": "tokens", "target": "target_tokens"}


def _check_shape(k: str, shape: tuple, what: Any, side: str | None, meta: dict[str, Any], name: str) -> None:
    """One tensor's shape against its layout and, where the stack's positions are tokens, the tokens."""
    layout = what.layout
    if len(shape) != len(layout):
        raise _fail(name, f"tensor {k} has shape {list(shape)}, expected {len(layout)} dimensions")
    tokens = meta.get("tokens")
    if tokens is None:
        return
    own = meta.get(_SIDES[side]) if side is not None else None
    if side is None and shape[0] == picture_count(meta):
        return  # a vision-language model's vision tower: one sequence per picture, not per text
    rows = own if own is not None else tokens
    sequence_first = layout == ("batch", "pos", "d_model") and shape[0] != len(rows) and shape[1] == len(rows)
    if shape[0] != len(rows) and not sequence_first:
        raise _fail(name, f"tensor {k} holds {shape[0]} texts, the metadata {len(rows)}")
    if own is None:
        return  # positions that are not tokens (pooled, patches): only the batch is checked
    if sequence_first:
        if shape[0] != _length(own):
            n = _length(own)
            raise _fail(name, f"tensor {k} spans {[shape[0]]} positions but the metadata has {[n]} tokens")
        return  # a sequence-first model's residual stream ([pos, batch, d_model]) as it ran
    keys = tokens if what.role == "cross" else own
    want = {"query": _length(own), "pos": _length(own), "key": _length(keys)}
    for axis, size in zip(layout, shape, strict=True):
        if axis in want and size != want[axis]:
            got = [s for a, s in zip(layout, shape, strict=True) if a in want]
            exp = [want[a] for a in layout if a in want]
            raise _fail(name, f"tensor {k} spans {got} positions but the metadata has {exp} tokens")
        if axis == "k" and size > want["key"]:
            raise _fail(name, f"tensor {k} keeps {size} keys per row, more than the {want['key']} tokens")


def _check_rows(meta: dict[str, Any], prefix: str, name: str) -> None:
    tokens = meta.get(f"{prefix}tokens")
    if tokens is None:
        return
    n = _length(tokens)
    ids = meta.get(f"{prefix}ids")
    if ids is not None and [len(r) for r in ids] != [len(r) for r in tokens]:
        raise _fail(name, f"metadata {prefix}ids and {prefix}tokens disagree in length")
    for field in (f"{prefix}attention_mask", f"{prefix}special_tokens_mask"):
        rows = meta.get(field)
        if rows is None:
            continue
        # rows are padded to the batch's length (older caches kept special-token rows unpadded)
        padded = field.endswith("attention_mask")
        if len(rows) != len(tokens) or any(
            len(r) != n and (padded or len(r) != len(t)) for r, t in zip(rows, tokens, strict=True)
        ):
            raise _fail(name, f"metadata {field} does not match the {len(tokens)} x {n} tokens")
