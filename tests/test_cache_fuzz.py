"""Fuzzing the cache reader: random mutations of a valid cache's header and metadata.

Every outcome must be a clean load (and then everything the Cache serves works, or refuses with a
ProbeError) or a ProbeError from :func:`probe.load`; never another exception. A seeded loop, so a
failure names the case that reproduces it.
"""

from __future__ import annotations

import copy
import json
import random
import struct

import pytest
import torch
from toys import ToyLM

import probe
from probe import ProbeError
from probe.cli import info_text

CASES = 3000
SEED = 20261122


def _values(rng: random.Random):
    return rng.choice(
        [
            None,
            True,
            0,
            -1,
            1,
            3,
            2**70,
            10**20,
            1.5,
            float("nan"),
            "",
            "x",
            "decoder",
            "encoder",
            "self_attn.pattern",
            "F32",
            [],
            [0],
            [0, 1],
            ["a", "b"],
            [[1, 2]],
            [["a"]],
            {},
            {"layers": 2},
            {"heads": 4},
            {"a": {"b": [1]}},
        ]
    )


def _nodes(obj, path=()):
    """Every (path, value) in a JSON tree."""
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _nodes(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _nodes(v, (*path, i))


def _mutate_tree(tree, rng: random.Random) -> str:
    nodes = list(_nodes(tree))
    path, value = rng.choice(nodes[1:] if len(nodes) > 1 else nodes)
    parent = tree
    for p in path[:-1]:
        parent = parent[p]
    last = path[-1] if path else None
    op = rng.choice(["replace", "replace", "delete", "add", "int", "dup"])
    if last is None:
        return "noop"
    if op == "replace":
        parent[last] = copy.deepcopy(_values(rng))
    elif op == "delete":
        del parent[last]
    elif op == "add" and isinstance(value, dict):
        value[rng.choice(["stack", "layer", "heads", "tokens", "model", "new", "layers"])] = _values(rng)
    elif op == "add" and isinstance(value, list):
        value.append(copy.deepcopy(value[0] if value else _values(rng)))
    elif op == "int" and isinstance(value, int) and not isinstance(value, bool):
        parent[last] = value + rng.choice([-2, -1, 1, 2, 10**6])
    elif op == "dup" and isinstance(parent, list):
        parent.insert(last, copy.deepcopy(value))
    else:
        parent[last] = copy.deepcopy(_values(rng))
    return f"{op} at {path}"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    torch.manual_seed(0)
    lm = ToyLM(n_layers=2, d=16, n_heads=2).eval()
    path = probe.capture(lm, torch.randint(0, 40, (2, 5))).save(
        tmp_path_factory.mktemp("fuzz") / "base.safetensors"
    )
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _case(header: dict, body: bytes, rng: random.Random) -> tuple[bytes, list[str]]:
    header = copy.deepcopy(header)
    meta = json.loads(header["__metadata__"]["probe"])
    done = []
    for _ in range(rng.randint(1, 3)):
        where = rng.random()
        if where < 0.55:
            done.append("meta: " + _mutate_tree(meta, rng))
        else:
            done.append("header: " + _mutate_tree(header, rng))
    if isinstance(header.get("__metadata__"), dict) and isinstance(header["__metadata__"].get("probe"), str):
        header["__metadata__"]["probe"] = json.dumps(meta)
    blob = bytearray(json.dumps(header).encode())
    blob += b" " * ((-len(blob)) % 8)
    n = len(blob)
    if rng.random() < 0.15:  # byte-level damage of the header
        for _ in range(rng.randint(1, 4)):
            blob[rng.randrange(len(blob))] = rng.randrange(256)
        done.append("bytes flipped")
    if rng.random() < 0.05:
        n += rng.choice([-8, -1, 1, 8, 2**40])
        done.append(f"length {n}")
    data = struct.pack("<Q", n) + bytes(blob) + body
    if rng.random() < 0.05:
        data = data[: rng.randrange(len(data))]
        done.append("truncated")
    return data, done


def _use(cache, path) -> None:
    """Touch everything a loaded cache serves, as an analysis or `probe info` would."""
    info_text(path)
    repr(cache)
    _ = cache.tokens, cache.target_tokens, cache.metadata
    for s in cache.stacks:
        for layer in cache.layer_indices(s):
            for kind in ("self", "cross"):
                try:
                    cache.pattern(s, layer, kind, head=0, batch=0)
                except ProbeError:
                    pass
    for k in cache.keys():
        assert cache[k].shape == cache.shape(k)


def test_every_mutation_loads_cleanly_or_is_a_probe_error(base, tmp_path):
    header, body = base
    rng = random.Random(SEED)
    outcomes = {"loaded": 0, "refused": 0}
    for i in range(CASES):
        data, done = _case(header, body, rng)
        path = tmp_path / f"case{i % 2}.safetensors"
        path.unlink(missing_ok=True)  # a new inode: an earlier case's memory map stays valid
        path.write_bytes(data)
        try:
            cache = probe.load(path)
        except ProbeError as e:
            assert "\n" not in str(e), (i, done, str(e))
            outcomes["refused"] += 1
            continue
        except Exception as e:  # pragma: no cover - the failure this test exists to find
            pytest.fail(f"case {i} ({done}): {type(e).__name__}: {e}")
        try:
            _use(cache, path)
        except Exception as e:  # pragma: no cover
            pytest.fail(f"case {i} ({done}) loaded, then {type(e).__name__}: {e}")
        outcomes["loaded"] += 1
    # both outcomes occur, so the mutations neither all break the file nor all miss
    assert outcomes["loaded"] > CASES // 100 and outcomes["refused"] > CASES // 2, outcomes
