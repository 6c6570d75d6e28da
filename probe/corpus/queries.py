"""SQL over a corpus run's per-text store: :class:`Store` (DuckDB over the Parquet shards, no import).

Three views, each over every shard's file of a finished run (:mod:`probe.corpus.store`):

* ``heads``: one row per (text, stack, layer, head, kind) with every statistic;
* ``texts``: one row per text (``source``, ``n_tokens``, ``tokens``, ``ids``, ``error``);
* ``examples``: what the run kept to show a head's top and bottom texts (:mod:`probe.corpus.examples`),
  when it kept any.

``store.query(sql)`` runs any SQL over them; :meth:`Store.top`, :meth:`Store.bottom` and
:meth:`Store.where` are the common questions, answered with the texts. Every answer is a
:class:`~probe.analysis.table.Table` (``to_pandas``, ``to_csv``, ``to_json``). DuckDB is the
``explore`` extra; a shard file that cannot be read is one line naming it.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any

from probe.analysis.focus.definitions.table import METRICS
from probe.analysis.table import Table
from probe.corpus.store import HEADS, INSTALL, TEXTS, shard_file
from probe.errors import ProbeError

EXAMPLES = "examples"  # shards/NNNNN.examples.parquet
TEXT_COLUMNS = ["source", "n_tokens"]


def duckdb() -> Any:
    """The ``duckdb`` module, or a one-line ProbeError naming the install command."""
    try:
        import duckdb as db
    except ImportError:
        raise ProbeError(f"querying a corpus run needs duckdb; install it with `{INSTALL}`") from None
    return db


def _sql_list(paths: list[Path]) -> str:
    return "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in paths) + "]"


class Store:
    """The per-text store of the finished corpus run at ``path`` (see the module docstring).

    One DuckDB database in memory, with views over the run's files; safe to share between threads
    (each query runs on its own cursor).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        m = self.path / "manifest.json"
        if not m.is_file():
            raise ProbeError(f"{self.path} is not a finished corpus run (no manifest.json); run probe corpus")
        manifest = json.loads(m.read_text(encoding="utf-8"))
        self.config = manifest["config"]
        if not self.config.get("store"):
            raise ProbeError(
                f"{self.path} was run without the per-text store (store=False, or pyarrow missing); "
                f"install it with `{INSTALL}` and run the corpus again into a new folder"
            )
        self.n_shards = int(manifest["n_shards"])
        self.files = {
            what: [shard_file(self.path, i, what) for i in range(self.n_shards)] for what in (HEADS, TEXTS)
        }
        ex = [shard_file(self.path, i, EXAMPLES) for i in range(self.n_shards)]
        if self.config.get("examples"):
            self.files[EXAMPLES] = ex
        for f in (f for fs in self.files.values() for f in fs):
            if not f.is_file():
                raise ProbeError(
                    f"{f} is missing; remove {f.parent / (f.name.split('.')[0] + '.json')} and rerun the "
                    "same corpus command to capture that shard again"
                )
        self._db = duckdb().connect(":memory:", config={"enable_object_cache": True})
        for what, files in self.files.items():
            self._db.execute(f"create view {what} as select * from read_parquet({_sql_list(files)})")
        self._lock = threading.Lock()

    # -- running SQL ----------------------------------------------------------------------------
    def execute(self, sql: str, params: list | None = None) -> Any:
        """A DuckDB result of ``sql`` with ``params`` (``?`` placeholders), on a fresh cursor;
        a shard that cannot be read is one ProbeError naming it."""
        db = duckdb()
        with self._lock:
            cur = self._db.cursor()
        try:
            return cur.execute(sql, params or [])
        except (db.IOException, db.InvalidInputException) as e:
            raise self._unreadable(e) from None
        except db.Error as e:
            first = (str(e).splitlines() or [""])[0]
            raise ProbeError(f"the query failed: {first}") from None

    def query(self, sql: str, params: list | None = None) -> Table:
        """The rows of any SQL over the views ``heads``, ``texts`` (and ``examples``) as a Table."""
        return _table(self.execute(sql, params))

    def check(self) -> Store:
        """Read every shard file's footer: a file that is not whole Parquet is one ProbeError
        naming it (a shard cut short by a full disk or a copy); returns self."""
        import pyarrow.parquet as pq

        for f in (f for fs in self.files.values() for f in fs):
            try:
                pq.read_metadata(f)
            except Exception as e:  # noqa: BLE001 - any failure to read it is the answer
                raise _corrupt(f, e) from None
        return self

    def _unreadable(self, error: Exception) -> ProbeError:
        """The one-line error for a failed read: the first shard file that cannot be read, named."""
        try:
            self.check()
        except ProbeError as e:
            return e
        first = (str(error).splitlines() or [""])[0]
        return ProbeError(f"cannot read the store of {self.path}: {first}")

    # -- the common questions --------------------------------------------------------------------
    @property
    def heads(self) -> dict[tuple[str, str], set[tuple[int, int]]]:
        """``(stack, kind) -> {(layer, head), ...}``: the heads of the run (from head_stats.json)."""
        if getattr(self, "_heads", None) is None:
            rows = json.loads((self.path / "head_stats.json").read_text(encoding="utf-8"))["rows"]
            heads: dict[tuple[str, str], set[tuple[int, int]]] = {}
            for r in rows:
                heads.setdefault((r["stack"], r["kind"]), set()).add((int(r["layer"]), int(r["head"])))
            self._heads = heads
        return self._heads

    def resolve(self, stack: str | None, kind: str = "self") -> str:
        """``stack``, or the run's only stack with ``kind`` attention (else ProbeError naming them)."""
        stacks = sorted(s for s, k in self.heads if k == kind)
        if stack is not None:
            if stack not in stacks:
                raise ProbeError(f"no {kind}-attention stack {stack!r} in this run; it has {stacks}")
            return stack
        if len(stacks) != 1:
            raise ProbeError(f"this run has {len(stacks)} stacks with {kind}-attention {stacks}; give stack=")
        return stacks[0]

    def top(
        self,
        layer: int,
        head: int,
        stat: str,
        k: int = 20,
        *,
        stack: str | None = None,
        kind: str = "self",
        descending: bool = True,
    ) -> Table:
        """The ``k`` texts where head ``layer``/``head`` has the largest ``stat`` (NaN left out;
        ties by text index): ``text``, ``stat``, this text's ``role`` for the head, ``source``,
        ``n_tokens``."""
        stat = check_stat(stat)
        if not isinstance(k, int) or k < 1:
            raise ProbeError(f"k={k!r}: give a positive integer")
        stack = self.resolve(stack, kind)
        self._check_head(stack, kind, layer, head)
        order = "desc" if descending else "asc"
        # the k rows first, then their texts: a join before the limit reads every text's row
        sql = (
            f'with best as (select text, "{stat}", role from heads where stack = ? and kind = ? and '
            f'layer = ? and head = ? and not isnan("{stat}") order by "{stat}" {order}, text limit {k}) '
            f'select b.text, b."{stat}", b.role, t.source, t.n_tokens from best b join texts t using (text) '
            f'order by b."{stat}" {order}, b.text'
        )
        t = self.query(sql, [stack, kind, int(layer), int(head)])
        t.title = (
            f"{'top' if descending else 'bottom'} {k} texts of {stack} layer {layer} head {head} by {stat}"
        )
        return t

    def bottom(self, layer: int, head: int, stat: str, k: int = 20, **kw: Any) -> Table:
        """The ``k`` texts with the smallest ``stat`` (as :meth:`top`)."""
        return self.top(layer, head, stat, k, descending=False, **kw)

    def where(self, condition: str, *, limit: int | None = None, order: str | None = None) -> Table:
        """Every (text, head) row where the SQL ``condition`` holds (over the columns of ``heads``:
        ``"first > 0.9 and layer = 3"``), with the text's ``source``; ``order``: an SQL ``order
        by`` (default: text, stack, layer, head); ``limit``: at most that many rows."""
        sql = f"select h.*, t.source from heads h join texts t using (text) where {condition}"
        sql += f" order by {order or 'h.text, h.stack, h.layer, h.head, h.kind'}"
        if limit is not None:
            sql += f" limit {int(limit)}"
        return self.query(sql)

    def text(self, index: int) -> dict[str, Any]:
        """Text ``index``'s row of ``texts`` (ProbeError when the run has no such text)."""
        rows = self.query("select * from texts where text = ?", [int(index)]).rows
        if not rows:
            raise ProbeError(f"no text {index} in this run (it has {self.config['n_texts']:,})")
        return rows[0]

    def _check_head(self, stack: str, kind: str, layer: int, head: int) -> None:
        if (int(layer), int(head)) not in self.heads.get((stack, kind), ()):
            raise ProbeError(f"no {stack} {kind}-attention layer {layer} head {head} in this run")

    def __repr__(self) -> str:
        return f"<probe.corpus.Store {self.path}: {self.config['n_texts']:,} texts, {self.n_shards} shards>"


def _corrupt(f: Path, e: Exception) -> ProbeError:
    shard = f.name.split(".")[0]
    why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    return ProbeError(
        f"{f} is corrupt or half-written ({why}); remove it and shards/{shard}.json and rerun the same "
        "corpus command to capture that shard again"
    )


def check_stat(stat: str) -> str:
    """``stat`` when it is a statistic of the table; else ProbeError listing them."""
    if stat not in METRICS:
        raise ProbeError(f"no statistic {stat!r}; choose one of: {', '.join(METRICS)}")
    return stat


def _table(result: Any) -> Table:
    """A DuckDB result as a :class:`Table` (NULL floats as NaN, as the statistics table has them)."""
    columns = [d[0] for d in result.description]
    floats = {d[0] for d in result.description if str(d[1]).upper() in ("FLOAT", "DOUBLE")}
    rows = []
    for values in result.fetchall():
        row = dict(zip(columns, values, strict=True))
        for c in floats:
            if row[c] is None:
                row[c] = math.nan
        rows.append(row)
    return Table(rows, columns)


__all__ = ["EXAMPLES", "Store", "check_stat", "duckdb"]
