"""CJK text in figures: find a CJK-capable font and use it as a per-glyph fallback.

Matplotlib (>= 3.6) falls back glyph by glyph through the families listed in
``rcParams["font.family"]``. :func:`context` returns an ``rc_context`` that appends the CJK font
found by :func:`cjk_font` to the user's own families, so Latin text keeps the user's font and
Chinese, Japanese and Korean characters are drawn with real glyphs. The figure functions create
their artists inside this context; a Text keeps the font properties it was created with, so the
figure saves correctly later, outside the context. Global rcParams are never changed.

Fonts installed after matplotlib built its font cache are found too (:func:`cjk_font` adds them
to matplotlib's font list once). When no CJK font is installed and a figure does contain CJK
text, one warning (per process) names the package to install, and matplotlib's per-glyph
"missing from font" warnings are silenced where probe saves figures; the figure still renders
(with missing-glyph boxes). Figures without CJK text never warn.
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import matplotlib as mpl
from matplotlib import font_manager
from matplotlib.ft2font import FT2Font

INSTALL_HINT = "apt-get install fonts-noto-cjk"

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
    """A font that covers CJK ideographs: its family ``name`` and file ``path``."""

    name: str
    path: str


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
    """The installed CJK-capable font matplotlib will use as fallback, or None if there is none.

    Looks through matplotlib's font list: first the :data:`PREFERRED` families, then any family
    whose name says CJK; a candidate counts only if its file has real glyphs for Chinese
    characters. When none is listed, the system fonts matplotlib does not list yet (installed
    after its font cache was built, e.g. ``fonts-noto-cjk`` after the first ``import
    matplotlib``) are added to its in-memory list once (:func:`add_unlisted_fonts`) and the
    search runs again. Cached for the process; matplotlib's cache file is left as it is.
    """
    font = _search(font_manager.fontManager.ttflist)
    if font is None and add_unlisted_fonts():
        font = _search(font_manager.fontManager.ttflist)
    return font


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


def _warn_missing() -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        "no CJK font found: Chinese/Japanese/Korean characters in figures will show as boxes; "
        f"install one (Debian/Ubuntu: `{INSTALL_HINT}`; other systems: any Noto Sans CJK font)",
        UserWarning,
        stacklevel=4,  # the caller of `with context(...)` (through contextlib)
    )


def families() -> list[str]:
    """``rcParams["font.family"]`` as it is now, with the CJK fallback family appended if found."""
    current = mpl.rcParams["font.family"]
    current = [current] if isinstance(current, str) else list(current)
    font = cjk_font()
    if font is not None and font.name not in current:
        current.append(font.name)
    return current


@contextlib.contextmanager
def context(texts: Iterable[str] = ()) -> Iterator[None]:
    """An ``rc_context`` in which CJK characters render with real glyphs.

    ``texts`` are the strings the figure will show; if any contains CJK and no CJK font is
    installed, warn once (naming the package) and render anyway.
    """
    font = cjk_font()
    if font is None:
        if any(has_cjk(t) for t in texts if t):
            _warn_missing()
        yield
        return
    with mpl.rc_context({"font.family": families()}):
        yield


@contextlib.contextmanager
def quiet_missing_glyphs() -> Iterator[None]:
    """Silence matplotlib's per-glyph "missing from font" warnings while drawing, when no CJK
    font exists (the one warning from :func:`context` already named the fix)."""
    with warnings.catch_warnings():
        if cjk_font() is None:
            warnings.filterwarnings("ignore", message=r"Glyph \d+ .* missing from font")
        yield


__all__ = [
    "CJKFont",
    "add_unlisted_fonts",
    "INSTALL_HINT",
    "cjk_font",
    "context",
    "covers",
    "families",
    "has_cjk",
    "quiet_missing_glyphs",
]
