"""CJK text in figures: find a CJK-capable font and use it as a per-glyph fallback.

Matplotlib (>= 3.6) falls back glyph by glyph through the families listed in
``rcParams["font.family"]``. :func:`context` returns an ``rc_context`` that appends the CJK font
found by :func:`cjk_font` to the user's own families, so Latin text keeps the user's font and
Chinese, Japanese and Korean characters are drawn with real glyphs. The figure functions create
their artists inside this context; a Text keeps the font properties it was created with, so the
figure saves correctly later, outside the context. Global rcParams are never changed.

Fonts installed after matplotlib built its font cache are found too (:func:`cjk_font` adds them
to matplotlib's font list once). When the system has no CJK font, probe draws with the one it
ships (:data:`BUNDLED`: "Probe CJK Fallback", a subset of Droid Sans Fallback with the 3,755
common hanzi of GB 2312 level 1 and every CJK character of probe's own labels), so a fresh
machine's figures are right. Only a figure with CJK characters that font lacks warns, once per
process, on a line of its own, naming the characters and the package to install; matplotlib's
per-glyph "missing from font" warnings are silenced where probe saves figures, and the figure
still renders (with missing-glyph boxes for those characters).
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import matplotlib as mpl
from matplotlib import font_manager
from matplotlib.ft2font import FT2Font

INSTALL_HINT = "apt-get install fonts-noto-cjk"
# the CJK font probe ships (fontdata/NOTICE.md): used when the system has none
BUNDLED = Path(__file__).resolve().parent / "fontdata" / "ProbeCJKFallback.ttf"
BUNDLED_NAME = "Probe CJK Fallback"

# Preferred families, best first: Simplified Chinese first because most of our users write it;
# then other common CJK fonts on Linux, macOS and Windows.
PREFERRED = (
    "Noto Sans CJK SC",
    "Noto Sans SC",
    "Source Han Sans SC",
    "Noto Sans CJK JP",
    "Noto Sans CJK TC",
    "Noto Sans CJK KR",
    "Source Han Sans",
    "WenQuanYi Zen Hei",
    "WenQuanYi Micro Hei",
    "Droid Sans Fallback",
    "PingFang SC",
    "Hiragino Sans GB",
    "Heiti SC",
    "Songti SC",
    "Microsoft YaHei",
    "SimHei",
    "Noto Serif CJK SC",
    "Arial Unicode MS",
)
# Characters a usable font must cover (注意力 = "attention").
_PROBE_CHARS = "注意力"
_CJK_RE = re.compile(
    "[\u1100-\u11ff\u2e80-\u2fdf\u3000-\u30ff\u3100-\u31ff\u3400-\u4dbf\u4e00-\u9fff"
    "\uac00-\ud7af\uf900-\ufaff\uff00-\uffef\U00020000-\U0003134f]"
)
_warned = False


@dataclass(frozen=True)
class CJKFont:
    """A font that covers CJK ideographs: its family ``name`` and file ``path``; ``bundled`` when
    it is the subset probe ships (:data:`BUNDLED`), which covers common Chinese only."""

    name: str
    path: str
    bundled: bool = False


def has_cjk(text: str) -> bool:
    """True if ``text`` contains a Chinese, Japanese or Korean character."""
    return bool(_CJK_RE.search(text))


def covers(path: str, chars: str = _PROBE_CHARS) -> bool:
    """True if the font file at ``path`` has a real glyph (not glyph 0, the box) for every char."""
    try:
        font = FT2Font(path)
    except (OSError, RuntimeError, ValueError):
        return False
    return all(font.get_char_index(ord(c)) != 0 for c in chars)


@functools.lru_cache(maxsize=1)
def cjk_font() -> CJKFont | None:
    """The CJK-capable font matplotlib will use as fallback: the system's, else the one probe ships.

    Looks through matplotlib's font list: first the :data:`PREFERRED` families, then any family
    whose name says CJK; a candidate counts only if its file has real glyphs for Chinese
    characters. When none is listed, the system fonts matplotlib does not list yet (installed
    after its font cache was built, e.g. ``fonts-noto-cjk`` after the first ``import
    matplotlib``) are added to its in-memory list once (:func:`add_unlisted_fonts`) and the
    search runs again. Without a system CJK font, :data:`BUNDLED` is added to the list and
    returned (``bundled=True``); None only if that file is missing. Cached for the process;
    matplotlib's cache file is left as it is.
    """
    font = _search(font_manager.fontManager.ttflist)
    if font is None and add_unlisted_fonts():
        font = _search(font_manager.fontManager.ttflist)
    if font is None and BUNDLED.is_file():
        font_manager.fontManager.addfont(str(BUNDLED))
        font = CJKFont(BUNDLED_NAME, str(BUNDLED), bundled=True)
    return font


@functools.lru_cache(maxsize=1)
def bundled_chars() -> frozenset[str]:
    """The characters :data:`BUNDLED` has glyphs for."""
    return frozenset(chr(c) for c in FT2Font(str(BUNDLED)).get_charmap())


def missing(texts: Iterable[str], font: CJKFont | None = None) -> str:
    """The CJK characters of ``texts`` that the fallback font (default :func:`cjk_font`) cannot
    draw, in order of first appearance: all of them without a CJK font, those the bundled subset
    lacks with it, none with a system CJK font."""
    font = cjk_font() if font is None else font
    if font is not None and not font.bundled:
        return ""
    have = bundled_chars() if font is not None else frozenset()
    out: dict[str, None] = {}
    for t in texts:
        for c in _CJK_RE.findall(t or ""):
            if c not in have:
                out[c] = None
    return "".join(out)


def _search(entries: list) -> CJKFont | None:
    by_name: dict[str, list[str]] = {}
    for e in entries:
        by_name.setdefault(e.name, []).append(e.fname)
    hinted = sorted(n for n in by_name if re.search(r"CJK|Han|Hei|Song|Ming|Gothic|YaHei", n))
    for name in [*PREFERRED, *hinted]:
        for path in sorted(set(by_name.get(name, [])), key=lambda p: ("Bold" in p, p)):
            if covers(path):
                return CJKFont(name, path)
    return None


def add_unlisted_fonts() -> list[str]:
    """Add the system's font files that matplotlib's font list lacks to that list (in memory, as
    matplotlib's own cache build would); returns their paths (empty when the list was current).

    Matplotlib scans the system fonts once, when it builds its cache file, so fonts installed
    later stay invisible to it until that file is deleted. Honours ``MPL_IGNORE_SYSTEM_FONTS``.
    """
    fm = font_manager.fontManager
    known = {e.fname for e in fm.ttflist}
    added = []
    for path in sorted(font_manager.findSystemFonts(fontext="ttf")):
        if path in known:
            continue
        try:
            fm.addfont(path)
        except (OSError, RuntimeError, ValueError):  # not a font FreeType can read
            continue
        added.append(path)
    return added


def _warn_missing(chars: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    shown = chars if len(chars) <= 12 else chars[:12] + "..."
    message = (
        f"no CJK font has glyphs for {shown} (they show as boxes in figures); install one "
        f"(Debian/Ubuntu: `{INSTALL_HINT}`; other systems: any Noto Sans CJK font)"
    )
    try:  # a line of its own, not the tail of a progress bar's line
        from tqdm import tqdm

        write_mode = tqdm.external_write_mode()
    except ImportError:  # pragma: no cover - tqdm is a dependency
        write_mode = contextlib.nullcontext()
    with write_mode:
        warnings.warn(message, UserWarning, stacklevel=4)  # the caller of `with context(...)`


def families() -> list[str]:
    """``rcParams["font.family"]`` as it is now, with the CJK fallback family appended if found."""
    current = mpl.rcParams["font.family"]
    current = [current] if isinstance(current, str) else list(current)
    font = cjk_font()
    if font is not None and font.name not in current:
        current.append(font.name)
    return current


def css_font_face(text: str) -> str:
    """A CSS ``@font-face`` rule that embeds, as a data URI, the glyphs of :data:`BUNDLED` for the
    CJK characters of ``text`` (an HTML page's own characters), under :data:`BUNDLED_NAME`; the
    empty string when ``text`` has none it covers. A page that lists the family after the
    system's fonts shows Chinese on a machine without a CJK font, offline, for a few KB."""
    import base64
    import io

    chars = sorted({c for c in _CJK_RE.findall(text)} & bundled_chars()) if BUNDLED.is_file() else []
    if not chars:
        return ""
    from fontTools import subset
    from fontTools.ttLib import TTFont

    font = TTFont(str(BUNDLED))
    options = subset.Options()
    options.name_IDs = [0, 1, 2, 3, 4, 5, 6]  # keep the copyright and the family's names
    sub = subset.Subsetter(options)
    sub.populate(text="".join(chars))
    sub.subset(font)
    buf = io.BytesIO()
    font.save(buf)
    data = base64.b64encode(buf.getvalue()).decode("ascii")
    source = f'url(data:font/ttf;base64,{data}) format("truetype")'
    return f'@font-face {{ font-family: "{BUNDLED_NAME}"; src: {source}; }}'


@contextlib.contextmanager
def context(texts: Iterable[str] = ()) -> Iterator[None]:
    """An ``rc_context`` in which CJK characters render with real glyphs.

    ``texts`` are the strings the figure will show; if any has a CJK character no font can draw
    (see :func:`missing`), warn once (naming the package) and render anyway.
    """
    font = cjk_font()
    lacking = missing(texts, font)
    if lacking:
        _warn_missing(lacking)
    if font is None:
        yield
        return
    with mpl.rc_context({"font.family": families()}):
        yield


@contextlib.contextmanager
def quiet_missing_glyphs() -> Iterator[None]:
    """Silence matplotlib's per-glyph "missing from font" warnings while drawing, unless a system
    CJK font draws every glyph (the one warning from :func:`context` already named the fix)."""
    with warnings.catch_warnings():
        font = cjk_font()
        if font is None or font.bundled:
            warnings.filterwarnings("ignore", message=r"Glyph \d+ .* missing from font")
        yield


__all__ = [
    "BUNDLED",
    "CJKFont",
    "bundled_chars",
    "css_font_face",
    "missing",
    "add_unlisted_fonts",
    "INSTALL_HINT",
    "cjk_font",
    "context",
    "covers",
    "families",
    "has_cjk",
    "quiet_missing_glyphs",
]
