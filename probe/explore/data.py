"""What the explorer shows, read from a corpus run: :class:`Explorer` (the store, the merged head
statistics, the examples, and what the model at hand can add).

Read-only: it opens the run's files and never writes them; a report made on demand goes to a
temporary folder of its own.
"""

from __future__ import annotations

import math
import re
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

from probe.analysis.focus.definitions.table import METRICS
from probe.corpus.queries import Store, check_stat
from probe.corpus.read import Corpus
from probe.corpus.showcase import capture_text, example_now
from probe.errors import ProbeError
from probe.report.html import report as write_report

HEAD_QUERY = re.compile(r"^\s*(?:l(?:ayer)?\s*)?(\d+)\s*(?:[.:/, ]|\s*h(?:ead)?)\s*(\d+)\s*$", re.I)
BINS = 30


class Explorer:
    """A corpus run as the app reads it. ``model``/``tokenizer``: the run's model, when at hand
    (texts are then captured again on demand: their report, and examples the run did not keep);
    ``composition``: rows of ``probe.composition(model).table`` (``stack``, ``src_layer``,
    ``src_head``, ``dst_layer``, ``dst_head``, ``q``, ``k``, ``v``) shown on each head's page."""

    def __init__(
        self, path: str | Path, *, model: Any = None, tokenizer: Any = None, composition: Any = None
    ) -> None:
        self.corpus = Corpus(path)
        self.store = Store(self.corpus.path).check()  # a damaged shard is one line, before serving
        self.model, self.tokenizer = model, tokenizer
        self.composition = list(composition or [])
        stats = self.corpus.head_stats()
        self.heads = {(r["stack"], r["kind"], r["layer"], r["head"]): r for r in stats.table}
        self.n_texts = stats.n_texts
        self.stacks = sorted({(s, k) for s, k, _, _ in self.heads}, key=lambda x: (x[1] != "self", x[0]))
        self.examples = self.corpus.config.get("examples") or {}
        self._reports: dict[int, Path] = {}
        self._report_dir: tempfile.TemporaryDirectory | None = None
        self._lock = threading.Lock()
        self._last_kept: dict[tuple, dict] = {}  # the last head and statistic's examples
        self._last_values: tuple[tuple | None, dict] = (None, {})  # ... and their values (values())

    # -- heads ---------------------------------------------------------------------------------
    def head(self, stack: str, kind: str, layer: int, head: int) -> dict[str, Any]:
        """The merged statistics row of one head (ProbeError when the run has no such head)."""
        row = self.heads.get((stack, kind, layer, head))
        if row is None:
            raise ProbeError(f"no {stack} {kind}-attention layer {layer} head {head} in this run")
        return row

    def grid(self, stack: str, kind: str, stat: str) -> tuple[list[int], list[int], dict]:
        """``(layers, heads, {(layer, head): mean})`` of one stack's heads for ``stat``."""
        check_stat(stat)
        cells = {(l_, h): r[stat] for (s, k, l_, h), r in self.heads.items() if s == stack and k == kind}
        if not cells:
            raise ProbeError(f"no {stack} {kind}-attention heads in this run")
        return sorted({l_ for l_, _ in cells}), sorted({h for _, h in cells}), cells

    def values(self, stack: str, kind: str, layer: int, head: int, stat: str) -> dict[str, Any]:
        """One head's ``stat`` over every text, read in one query: ``text`` (int64) and ``value``
        (float64, NaN where undefined) arrays and ``role`` (a list), in the store's order. The
        last head and statistic read are kept: a head page's histogram and both of its rankings
        come from one read of the store."""
        check_stat(stat)
        key = (stack, kind, int(layer), int(head), stat)
        with self._lock:
            if self._last_values[0] == key:
                return self._last_values[1]
        got = self.store.execute(
            f'select text, "{stat}" as value, role from heads where stack = ? and kind = ? and layer = ? '
            "and head = ?",
            [stack, kind, int(layer), int(head)],
        ).fetchnumpy()
        out = {
            "text": np.asarray(got["text"], dtype=np.int64),
            # a NULL (an older run's missing value) reads as NaN, as the store writes an undefined one
            "value": np.ma.filled(np.ma.asarray(got["value"]).astype(np.float64), np.nan),
            "role": np.ma.filled(np.ma.asarray(got["role"]).astype(object), ""),
        }
        with self._lock:
            self._last_values = (key, out)
        return out

    def distribution(self, stack: str, kind: str, layer: int, head: int, stat: str) -> dict[str, Any]:
        """The histogram of one head's ``stat`` over the texts: ``bins`` (counts of ``BINS`` equal
        bins from ``lo`` to ``hi``, the largest value in the last), ``lo``, ``hi``, ``n`` (texts
        with a value), ``missing`` (texts where it is undefined)."""
        v = self.values(stack, kind, layer, head, stat)["value"]
        ok = v[~np.isnan(v)]
        counts = [0] * BINS
        if not ok.size:
            return {"bins": counts, "lo": None, "hi": None, "n": 0, "missing": int(v.size)}
        lo, hi = float(ok.min()), float(ok.max())
        width = (hi - lo) / BINS if hi > lo else 1.0
        b = np.minimum(np.floor((ok - lo) / width).astype(np.int64), BINS - 1)
        counts = np.bincount(b, minlength=BINS).tolist()
        return {"bins": counts, "lo": lo, "hi": hi, "n": int(ok.size), "missing": int(v.size - ok.size)}

    def ranked(
        self, stack: str, kind: str, layer: int, head: int, stat: str, k: int, top: bool
    ) -> list[dict]:
        """The ``k`` texts with the largest (``top``) or smallest ``stat`` for one head (NaN left
        out, ties by text index, as :meth:`~probe.corpus.queries.Store.top`): ``text``, ``stat``'s
        value, ``role``, ``source``, ``n_tokens``, ``tokens``, ``ids``, ``picture`` (a picture
        run's stored copy, else None) and, where kept (or capturable), its ``example``
        (:meth:`example`)."""
        if not isinstance(k, int) or k < 1:
            raise ProbeError(f"k={k!r}: give a positive integer")
        self._check_head(stack, kind, layer, head)
        got = self.values(stack, kind, layer, head, stat)
        v, text = got["value"], got["text"]
        ok = np.flatnonzero(~np.isnan(v))
        key = -v[ok] if top else v[ok]  # ascending: the first k are the ones shown
        if key.size > k:  # the k smallest keys and every tie of the k-th, found without a full sort
            ok = ok[key <= np.partition(key, k - 1)[k - 1]]
            key = -v[ok] if top else v[ok]
        # sort by value (descending for the top), then text index; lexsort's last key leads
        order = ok[np.lexsort((text[ok], key))][:k]
        if not order.size:
            return []
        index = [int(text[i]) for i in order]
        texts = self._texts(index)
        kept = self._kept(stack, kind, layer, head, stat, "top" if top else "bottom")
        rows = []
        for i, t in zip(order, index, strict=True):
            r = texts[t]
            rows.append({
                "text": t, stat: float(v[i]), "role": str(got["role"][i]), "source": r["source"],
                "n_tokens": r["n_tokens"], "tokens": r["tokens"], "ids": r["ids"], "example": kept.get(t),
                "picture": r["picture"],
            })  # fmt: skip
        return rows

    def _check_head(self, stack: str, kind: str, layer: int, head: int) -> None:
        self.head(stack, kind, layer, head)

    def _texts(self, index: list[int]) -> dict[int, dict]:
        marks = ", ".join("?" * len(index))
        rows = self.store.query(
            f"select text, source, n_tokens, tokens, ids, picture from texts where text in ({marks})", index
        )
        return {r["text"]: r for r in rows}

    def _kept(
        self, stack: str, kind: str, layer: int, head: int, stat: str, direction: str
    ) -> dict[int, dict]:
        """The examples the run kept for one head, statistic and direction: text -> example."""
        if stat not in self.examples.get("stats", []):
            return {}
        key = (stack, kind, int(layer), int(head), stat)
        with self._lock:
            both = self._last_kept.get(key)
        if both is None:  # both directions in one read of the examples: a head page shows both
            rows = self.store.query(
                "select direction, text, positions, terms, keys, weights, targets from examples where "
                "stack = ? and kind = ? and layer = ? and head = ? and stat = ?",
                [stack, kind, int(layer), int(head), stat],
            )
            both = {"top": {}, "bottom": {}}
            for r in rows:
                both[r["direction"]][r["text"]] = r
            with self._lock:
                self._last_kept = {key: both}
        return both[direction]

    def capture_example(self, text: int, where: tuple, head: int, stat: str, top: bool) -> dict:
        """One text's example captured now with the model at hand (``where`` = ``(stack, layer,
        kind)``; ProbeError without a model)."""
        ex = example_now(
            self.model,
            self.tokenizer,
            self._source(text),
            where,
            head,
            stat,
            "top" if top else "bottom",
            self.examples,
        )
        return vars(ex)

    def _source(self, text: int) -> str:
        if self.model is None:
            raise ProbeError("capturing a text again needs the run's model: probe serve RUN_DIR --model NAME")
        row = self.store.text(text)
        if row["error"]:
            raise ProbeError(f"text {text} failed in this run: {row['error']}")
        return row["source"]

    def partners(self, stack: str, layer: int, head: int, n: int = 5) -> dict[str, list[dict]]:
        """The heads that read this head's output most (``"readers"``) and the heads whose output
        it reads most (``"writers"``), by the largest of Q-, K- and V-composition; ``n`` each."""
        mine = [r for r in self.composition if r["stack"] == stack]

        def score(r: dict) -> float:
            return max(r["q"], r["k"], r["v"])

        readers = [r for r in mine if r["src_layer"] == layer and r["src_head"] == head]
        writers = [r for r in mine if r["dst_layer"] == layer and r["dst_head"] == head]
        return {
            "readers": sorted(readers, key=score, reverse=True)[:n],
            "writers": sorted(writers, key=score, reverse=True)[:n],
        }

    # -- texts ---------------------------------------------------------------------------------
    def text(self, index: int) -> dict[str, Any]:
        """Text ``index``'s row (source, tokens, ids, error, picture)."""
        if not 0 <= index < self.corpus.manifest["n_texts"]:
            raise ProbeError(f"no text {index}: this run has texts 0-{self.corpus.manifest['n_texts'] - 1}")
        return self.store.text(index)

    def text_grid(self, index: int, stack: str, kind: str, stat: str) -> dict[tuple[int, int], float]:
        """``{(layer, head): value}`` of one text's ``stat`` over a stack's heads."""
        check_stat(stat)
        rows = self.store.execute(
            f'select layer, head, "{stat}" from heads where text = ? and stack = ? and kind = ?',
            [int(index), stack, kind],
        ).fetchall()
        return {(int(l_), int(h)): (math.nan if v is None else float(v)) for l_, h, v in rows}

    def report(self, index: int) -> Path:
        """The HTML report of text ``index`` (captured again with the model), made once per text."""
        with self._lock:
            if index in self._reports:
                return self._reports[index]
        cache = capture_text(self.model, self.tokenizer, self._source(index))
        with self._lock:
            if self._report_dir is None:
                self._report_dir = tempfile.TemporaryDirectory(prefix="probe-serve-")
            out = Path(self._report_dir.name) / str(index)
        path = write_report(cache, out, model=self.model, tokenizer=self.tokenizer, progress=False)
        with self._lock:
            self._reports[index] = path
        return path

    # -- search --------------------------------------------------------------------------------
    def search(self, q: str, limit: int = 50) -> dict[str, list]:
        """Texts whose source contains ``q`` (case-insensitive), and the heads ``q`` names: a head
        (``L18H6``, ``18.6``, ``layer 18 head 6``), a role (``induction``) or a statistic."""
        q = q.strip()
        out: dict[str, list] = {"texts": [], "heads": [], "stats": []}
        if not q:
            return out
        like = "%" + q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        out["texts"] = self.store.query(
            "select text, source, n_tokens, error from texts where source ilike ? escape '\\' "
            f"order by text limit {int(limit)}",
            [like],
        ).rows
        m = HEAD_QUERY.match(q)
        low = q.lower()
        for r in self.heads.values():
            named = m and (r["layer"], r["head"]) == (int(m.group(1)), int(m.group(2)))
            if named or low in r["roles"].split(","):
                out["heads"].append(r)
        out["stats"] = [s for s in METRICS if low in s]
        return out

    def close(self) -> None:
        """Remove the reports made on demand."""
        if self._report_dir is not None:
            self._report_dir.cleanup()


__all__ = ["BINS", "Explorer"]
