"""The shared result table (exports) and the atomic file writer."""

import csv
import io
import json
import math
import os
import stat

import pytest

from probe.analysis.table import Exports, Table
from probe.errors import ProbeError
from probe.files import atomic_path, write_text_atomic

ROWS = [
    {"layer": 0, "head": 1, "entropy": 0.5, "role": "prev"},
    {"layer": 1, "head": 0, "entropy": float("nan"), "role": "<b>x</b>"},
    {"layer": 1, "head": 1, "entropy": 2.0, "role": "sink"},
]


def test_exports_round_trip():
    t = Table(ROWS, title="stats")
    d = t.to_dict()
    assert d["columns"] == ["layer", "head", "entropy", "role"] and len(d["rows"]) == 3
    j = json.loads(t.to_json())
    assert j["rows"][1]["entropy"] is None and j["rows"][2]["entropy"] == 2.0
    rows = list(csv.DictReader(io.StringIO(t.to_csv())))
    assert [r["role"] for r in rows] == ["prev", "<b>x</b>", "sink"]
    assert float(rows[0]["entropy"]) == 0.5


def test_sort_top_nan_last_and_bad_column():
    t = Table(ROWS)
    assert [r["entropy"] for r in t.top("entropy", 2).rows] == [2.0, 0.5]
    asc = t.sorted("entropy", descending=False).column("entropy")
    assert asc[:2] == [0.5, 2.0] and math.isnan(asc[2])
    with pytest.raises(ProbeError, match="no column 'nope'"):
        t.top("nope")


def test_html_is_escaped():
    html = Table(ROWS)._repr_html_()
    assert "<b>x</b>" not in html and "&lt;b&gt;x&lt;/b&gt;" in html


def test_atomic_write_mode_and_cleanup(tmp_path):
    old = os.umask(0o022)
    try:
        p = write_text_atomic(tmp_path / "a.json", "{}")
    finally:
        os.umask(old)
    assert p.read_text() == "{}" and stat.S_IMODE(p.stat().st_mode) == 0o644
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "b.txt") as tmp:
        tmp.write_text("half")
        raise RuntimeError("boom")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["a.json"]


class _Result(Exports):
    """A result with nested numbers and a table named other than ``table``."""

    _exported = "words"

    def __init__(self):
        self.words = Table(ROWS)

    def to_dict(self):
        return {"mean": float("nan"), "by": {"a": [1.5, float("inf")]}, "words": self.words.to_dict()}


def test_result_exports_write_finite_json_atomically(tmp_path):
    r = _Result()
    path = tmp_path / "r.json"
    d = json.loads(r.to_json(path))
    assert d["mean"] is None and d["by"]["a"] == [1.5, None] and d["words"]["rows"][1]["entropy"] is None
    assert json.loads(path.read_text(encoding="utf-8")) == d and [p.name for p in tmp_path.iterdir()] == [
        "r.json"
    ]
    rows = list(csv.DictReader(io.StringIO(r.to_csv())))
    assert [row["head"] for row in rows] == ["1", "0", "1"]
