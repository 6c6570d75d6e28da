"""Rebuild ``ProbeCJKFallback.ttf``, the CJK glyphs probe ships for figures and reports.

A subset of Droid Sans Fallback (Google, Apache License 2.0; Debian's ``fonts-droid-fallback``
ships it as ``DroidSansFallbackFull.ttf``), renamed "Probe CJK Fallback" so that it never stands
in for a system copy of the full font. It keeps the 3,755 characters of GB 2312 level 1 (the
common hanzi of Simplified Chinese), every CJK character in probe's and the zoo's own sources
(the tutorial figures' axis labels among them), CJK punctuation and the full-width forms:

    apt-get download fonts-droid-fallback && dpkg -x fonts-droid-fallback_*.deb droid
    python probe/report/fontdata/build.py droid/usr/share/fonts/truetype/droid/DroidSansFallbackFull.ttf
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from fontTools import subset
from fontTools.ttLib import TTFont

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent.parent
FAMILY = "Probe CJK Fallback"
CJK = re.compile("[\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef]")


def characters() -> str:
    level1 = [(hi, lo) for hi in range(0xB0, 0xD8) for lo in range(0xA1, 0xFF) if (hi, lo) < (0xD7, 0xFA)]
    chars = {bytes(code).decode("gb2312") for code in level1}  # GB 2312 level 1: B0A1 to D7F9
    chars |= {chr(c) for c in range(0x3000, 0x3040)} | {chr(c) for c in range(0xFF01, 0xFF5F)}
    for folder in ("probe", "models"):
        for path in (ROOT / folder).rglob("*.py"):
            chars |= set(CJK.findall(path.read_text(encoding="utf-8")))
    return "".join(sorted(chars))


def build(source: str, out: Path = HERE / "ProbeCJKFallback.ttf") -> Path:
    font = TTFont(source)
    options = subset.Options()
    options.hinting = False
    options.layout_features = ["*"]
    sub = subset.Subsetter(options)
    sub.populate(text=characters())
    sub.subset(font)
    for rec in font["name"].names:  # family, unique, full and typographic names; PostScript name
        if rec.nameID in (1, 3, 4, 6, 16):
            rec.string = FAMILY.replace(" ", "") if rec.nameID == 6 else FAMILY
    font.save(out)
    return out


if __name__ == "__main__":
    print(build(sys.argv[1]))
