"""``probe circuit``: the command line passes the prompts through and writes what the API computes.

Oracle: :func:`probe.circuit` called in the test on the same prompts (the CLI must export exactly
its scores), and the files read back with ``json``/``csv``.
"""

from __future__ import annotations

import csv
import json

import pytest

from probe.cli import main

CLEAN = ["attention lets tokens read", "the model reads the tokens"]
CORRUPT = ["attention lets tokens send", "the model sends the tokens"]


@pytest.fixture()
def prompts(tmp_path):
    (tmp_path / "clean.txt").write_text("\n".join(CLEAN) + "\n", encoding="utf-8")
    (tmp_path / "corrupt.txt").write_text("\n".join(CORRUPT) + "\n", encoding="utf-8")
    return tmp_path


def test_circuit_command_exports_the_api_result(prompts, capsys):
    import models
    import probe
    from probe.intervene.circuit import Circuit

    d = prompts
    args = ["circuit", "--model", "minigpt", "--clean", str(d / "clean.txt"), "--corrupted"]
    args += [str(d / "corrupt.txt"), "--metric", "kl", "--method", "eap-ig", "--steps", "2", "--top", "3"]
    args += ["--curve", "4,110", "--json", str(d / "g.json"), "--csv", str(d / "e.csv")]
    assert main(args) == 0
    out = capsys.readouterr().out
    api = probe.circuit(models.load("minigpt"), CLEAN, CORRUPT, metric="kl", method="eap-ig", steps=2)
    assert api.summary() in out
    assert api.table.rows[0]["edge"] in out and "faithfulness" in out
    back = Circuit.from_json((d / "g.json").read_text(encoding="utf-8"))
    assert back.graph.to_dict() == api.graph.to_dict()
    want = {r["edge"]: r["score"] for r in api.table.rows}
    got = {e["edge"]: e["score"] for e in json.loads((d / "g.json").read_text(encoding="utf-8"))["edges"]}
    assert got.keys() == want.keys()
    assert all(abs(got[k] - want[k]) <= 1e-6 * (1 + abs(want[k])) for k in want)
    with open(d / "e.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(api.table) and rows[0]["edge"] == api.table.rows[0]["edge"]


def test_circuit_command_refusals(prompts, capsys):
    d = prompts
    (d / "short.txt").write_text(CORRUPT[0] + "\n", encoding="utf-8")
    (d / "answers.tsv").write_text("a\tb\n", encoding="utf-8")
    base = ["circuit", "--model", "minigpt", "--clean", str(d / "clean.txt")]
    cases = [
        (["--corrupted", str(d / "short.txt"), "--metric", "kl"], "--clean has 2 prompts but --corrupted 1"),
        (["--corrupted", str(d / "nope.txt"), "--metric", "kl"], "does not exist"),
        (
            ["--corrupted", str(d / "corrupt.txt"), "--answers-file", str(d / "answers.tsv")],
            "one line per prompt",
        ),
        (["--corrupted", str(d / "corrupt.txt"), "--answers", "a", "b", "c"], "CORRECT [WRONG]"),
    ]
    for extra, message in cases:
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "Traceback" not in err
