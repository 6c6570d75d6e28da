"""The explorer's web app: a Starlette application over an :class:`~probe.explore.data.Explorer`.

Pages (every state in the URL, so a link shows what its sender saw; back and forward work):

* ``/?stat=first&stack=decoder&kind=self``: the layer x head grid coloured by a statistic's mean;
* ``/head/STACK/KIND/LAYER/HEAD?stat=...&k=20``: one head: its statistics and role, the statistic's
  distribution over the texts, its top and bottom texts with the positions and keys marked, and
  the heads it composes with (when the model is at hand);
* ``/text/INDEX?stat=...``: one text: its tokens (or picture) and its value of the statistic at
  every head; ``/text/INDEX/report``: the HTML report of it (captured again: needs the model);
* ``/search?q=...``: texts containing ``q``; heads named (``L18H6``) or of a role; statistics;
* ``/api/example/...``: one example captured now (JSON), for texts the run kept no example of.

Only GET; every asset is served from the package (no other host is ever asked for anything: the
Content-Security-Policy says so to the browser).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2

from probe.analysis.focus.definitions.table import METRICS
from probe.errors import ProbeError
from probe.explore.data import Explorer
from probe.explore.views import fmt, grid_view, histogram_svg, tokens_view

CSP = "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; object-src 'none'"
# a report is one self-contained file: inline scripts, styles, fonts and pictures, nothing fetched
REPORT_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; "
    "font-src data:; media-src data:"
)
DEFAULT_STAT = "first"


def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(resources.files("probe.explore") / "templates")),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["fmt"] = fmt
    return env


class Pages:
    """The handlers of every page, over one explorer."""

    def __init__(self, ex: Explorer) -> None:
        self.ex = ex
        self.env = _env()

    # -- helpers ---------------------------------------------------------------------------------
    def _page(self, name: str, **ctx: Any) -> Any:
        from starlette.responses import HTMLResponse

        ctx.setdefault("stats", METRICS)
        ctx.setdefault("q", "")
        ctx["run"] = self.ex.corpus.path.name
        ctx["n_texts"] = self.ex.corpus.manifest["n_texts"]
        inputs = self.ex.corpus.config.get("inputs")
        ctx["sound"] = inputs == "audio"  # its pictures are spectrograms
        ctx["positions"] = inputs in ("audio", "images")  # tokens are positions: shown apart
        return HTMLResponse(
            self.env.get_template(name).render(**ctx), headers={"Content-Security-Policy": CSP}
        )

    def _state(self, request: Any) -> dict[str, str]:
        """``stat``, ``stack`` and ``kind`` of the URL (defaults: the first stack's self-attention)."""
        stack, kind = self.ex.stacks[0]
        p = request.query_params
        stat = p.get("stat", DEFAULT_STAT)
        if stat not in METRICS:
            raise ProbeError(f"no statistic {stat!r}; choose one of: {', '.join(METRICS)}")
        return {"stat": stat, "stack": p.get("stack", stack), "kind": p.get("kind", kind)}

    @staticmethod
    def _head_url(stack: str, kind: str, layer: int, head: int, **q: Any) -> str:
        return f"/head/{stack}/{kind}/{layer}/{head}?{urlencode(q)}"

    # -- pages -----------------------------------------------------------------------------------
    def grid(self, request: Any) -> Any:
        s = self._state(request)
        layers, heads, cells = self.ex.grid(s["stack"], s["kind"], s["stat"])

        def title(layer: int, head: int) -> str:
            r = self.ex.head(s["stack"], s["kind"], layer, head)
            return f"L{layer}H{head}: {s['stat']} {fmt(r[s['stat']])}; role {r['role']}"

        def href(layer: int, head: int) -> str:
            return self._head_url(s["stack"], s["kind"], layer, head, stat=s["stat"])

        grid = grid_view(layers, heads, cells, href, title)
        return self._page("grid.html.j2", grid=grid, stacks=self.ex.stacks, **s)

    def head(self, request: Any) -> Any:
        s = self._state(request)
        stack, kind = request.path_params["stack"], request.path_params["kind"]
        layer, head = request.path_params["layer"], request.path_params["head"]
        k = _int(request.query_params.get("k", "20"), "k", 1, 200)
        row = self.ex.head(stack, kind, layer, head)
        dist = self.ex.distribution(stack, kind, layer, head, s["stat"])
        lists = {}
        for name, top in (("top", True), ("bottom", False)):
            rows = self.ex.ranked(stack, kind, layer, head, s["stat"], k, top)
            for r in rows:
                r["view"] = tokens_view(r["tokens"], r["example"])
            lists[name] = rows
        neighbours = {
            "prev": self._neighbour(stack, kind, layer, head, -1, s["stat"]),
            "next": self._neighbour(stack, kind, layer, head, 1, s["stat"]),
        }
        return self._page(
            "head.html.j2", row=row, hist=histogram_svg(dist, row[s["stat"]]), dist=dist, lists=lists, k=k,
            partners=self.ex.partners(stack, layer, head), can_capture=self.ex.model is not None,
            kept=s["stat"] in self.ex.examples.get("stats", []), neighbours=neighbours,
            stat=s["stat"], stack=stack, kind=kind, layer=layer, head=head,
            grid_url="/?" + urlencode({"stat": s["stat"], "stack": stack, "kind": kind}),
        )  # fmt: skip

    def _neighbour(self, stack: str, kind: str, layer: int, head: int, step: int, stat: str) -> str | None:
        keys = sorted((l_, h) for s, k, l_, h in self.ex.heads if s == stack and k == kind)
        i = keys.index((layer, head)) + step
        if not 0 <= i < len(keys):
            return None
        return self._head_url(stack, kind, *keys[i], stat=stat)

    def text(self, request: Any) -> Any:
        s = self._state(request)
        index = request.path_params["index"]
        row = self.ex.text(index)
        grid = None
        if not row["error"]:
            cells = self.ex.text_grid(index, s["stack"], s["kind"], s["stat"])
            layers = sorted({l_ for l_, _ in cells})
            heads = sorted({h for _, h in cells})

            def href(layer: int, head: int) -> str:
                return self._head_url(s["stack"], s["kind"], layer, head, stat=s["stat"])

            grid = grid_view(layers, heads, cells, href)
        n = self.ex.corpus.manifest["n_texts"]
        return self._page(
            "text.html.j2", index=index, row=row, view=tokens_view(row["tokens"], None), grid=grid,
            can_report=self.ex.model is not None, prev=index - 1 if index > 0 else None,
            next=index + 1 if index + 1 < n else None, stacks=self.ex.stacks, **s,
        )  # fmt: skip

    def report(self, request: Any) -> Any:
        from starlette.responses import HTMLResponse

        path = self.ex.report(request.path_params["index"])
        return HTMLResponse(
            Path(path).read_text(encoding="utf-8"), headers={"Content-Security-Policy": REPORT_CSP}
        )

    def search(self, request: Any) -> Any:
        s = self._state(request)
        q = request.query_params.get("q", "")
        found = self.ex.search(q)
        heads = [
            {**r, "href": self._head_url(r["stack"], r["kind"], r["layer"], r["head"], stat=s["stat"])}
            for r in found["heads"]
        ]
        return self._page(
            "search.html.j2", q=q, texts=found["texts"], heads=heads, found_stats=found["stats"], **s
        )

    def example(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        p, q = request.path_params, request.query_params
        stat = q.get("stat", DEFAULT_STAT)
        if stat not in METRICS:
            raise ProbeError(f"no statistic {stat!r}")
        where = (p["stack"], p["layer"], p["kind"])
        ex = self.ex.capture_example(p["index"], where, p["head"], stat, q.get("dir", "top") == "top")
        return JSONResponse(json.loads(tokens_view(self.ex.text(p["index"])["tokens"], ex)["data"]))


def _int(value: str, name: str, lo: int, hi: int) -> int:
    try:
        v = int(value)
    except ValueError:
        raise ProbeError(f"{name}={value!r}: give a whole number from {lo} to {hi}") from None
    if not lo <= v <= hi:
        raise ProbeError(f"{name}={v}: give a whole number from {lo} to {hi}")
    return v


def create_app(ex: Explorer) -> Any:
    """The Starlette application serving ``ex`` (see the module docstring)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    pages = Pages(ex)

    def guarded(handler: Any) -> Any:
        def run(request: Request) -> Any:
            try:
                return handler(request)
            except ProbeError as e:
                if request.url.path.startswith("/api/"):
                    return JSONResponse({"error": str(e)}, status_code=404)
                page = pages.env.get_template("error.html.j2").render(
                    message=str(e),
                    stats=METRICS,
                    q="",
                    run=ex.corpus.path.name,
                    n_texts=ex.corpus.manifest["n_texts"],
                )
                return HTMLResponse(page, status_code=404, headers={"Content-Security-Policy": CSP})

        return run

    head = "/{stack}/{kind}/{layer:int}/{head:int}"
    routes = [
        Route("/", guarded(pages.grid)),
        Route(f"/head{head}", guarded(pages.head)),
        Route("/text/{index:int}", guarded(pages.text)),
        Route("/text/{index:int}/report", guarded(pages.report)),
        Route("/search", guarded(pages.search)),
        Route(f"/api/example/{{index:int}}{head}", guarded(pages.example)),
        Mount(
            "/static", StaticFiles(directory=str(resources.files("probe.explore") / "static")), name="static"
        ),
    ]
    app = Starlette(routes=routes)
    app.state.explorer = ex
    return app


__all__ = ["CSP", "REPORT_CSP", "Pages", "create_app"]
