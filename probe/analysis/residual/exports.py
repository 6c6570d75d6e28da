"""One place for the table exports the residual results share (JSON, CSV, pandas, HTML)."""

from __future__ import annotations

from probe.analysis.table import Table


class TableExports:
    """Mixin: ``to_json``/``to_csv``/``to_pandas``/``_repr_html_`` of the result's main table.

    A subclass names that table in :meth:`main_table`; its other tables export themselves.
    """

    def main_table(self) -> Table:  # pragma: no cover - every subclass overrides it
        raise NotImplementedError

    def to_json(self, path=None, **kw) -> str:
        """The main table as JSON (NaN as null); also written to ``path`` (atomically) if given."""
        return self.main_table().to_json(path, **kw)

    def to_csv(self, path=None) -> str:
        """The main table as CSV; also written to ``path`` (atomically) if given."""
        return self.main_table().to_csv(path)

    def to_pandas(self):
        """The main table as a ``pandas.DataFrame``."""
        return self.main_table().to_pandas()

    def _repr_html_(self) -> str:
        return self.main_table()._repr_html_() + "".join(
            f"<p>note: {_esc(n)}</p>" for n in getattr(self, "notes", [])
        )


def _esc(text: str) -> str:
    import html

    return html.escape(text)


__all__ = ["TableExports"]
