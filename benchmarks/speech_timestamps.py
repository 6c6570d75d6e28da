"""Word-timestamp error of the zoo speech model against the known word boundaries.

    python benchmarks/speech_timestamps.py          # the shipped `speech` checkpoint
    python benchmarks/speech_timestamps.py --json out.json

The 60 held-out sentences of `models.speech_data` (`TEST_SEEDS`: every word synthesized alone by
espeak-ng and placed at a sample the generator knows) are captured with
`probe.capture(model, waveforms, processor=model.processor, target=transcripts)` and their word
times read by `probe.word_timestamps` (Whisper's recipe: each head standardised per frame over the tokens,
median filter, dynamic time warping on the chosen heads' cross-attention). Scored against the
gold (start, end) of every word: the mean absolute boundary error in ms (starts and ends) and the
share of boundaries within 20, 50 and 100 ms:

- each decoder layer and head used alone (on the test sentences);
- the heads chosen without gold (`heads=None`: the monotone, diagonal ones);
- the heads chosen WITH gold, chosen on 30 other validation sentences (seeds `VALIDATION_SEEDS`)
  and then scored on the test sentences, so the choice never sees the test gold.

Whisper's words are contiguous (a word ends where the next begins, the first starts at the
first frame), while the gold words are separated by silences: `starts` and `ends` split the error,
and `starts after the first word` leaves out the lead silence the first word's start absorbs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import models  # noqa: E402
import probe  # noqa: E402
from models import speech_data  # noqa: E402
from probe.analysis.table import Table  # noqa: E402

VALIDATION_SEEDS = tuple(range(950_000, 950_030))


def gold(sentences: list[speech_data.Sentence]) -> list[list[tuple[str, float, float]]]:
    """Per sentence per word ``(word, start, end)`` in seconds, from the generator's spans."""
    return [[(w, a, b) for w, (a, b) in zip(s.words, s.times, strict=True)] for s in sentences]


def capture(model, sentences: list[speech_data.Sentence]):
    """The cache of ``sentences`` through the model's processor, the transcripts as target."""
    return probe.capture(
        model,
        [s.audio for s in sentences],
        processor=model.processor,
        sampling_rate=speech_data.SAMPLE_RATE,
        target=[s.text for s in sentences],
    )


def summary(errors: list[float]) -> dict[str, float]:
    """Mean absolute error (ms) and the shares within 20/50/100 ms of ``errors`` (ms)."""
    n = len(errors)
    return {
        "boundaries": n,
        "mean_error_ms": round(sum(errors) / n, 1),
        "within_20ms": round(sum(e <= 20 for e in errors) / n, 3),
        "within_50ms": round(sum(e <= 50 for e in errors) / n, 3),
        "within_100ms": round(sum(e <= 100 for e in errors) / n, 3),
    }


def split(ts: probe.WordTimestamps) -> dict[str, dict[str, float]]:
    """The boundary errors of ``ts`` (which holds gold) summarised: all, starts, ends, and starts
    after each sentence's first word."""
    rows = list(ts.words.rows)
    starts = [r["start_error_ms"] for r in rows]
    ends = [r["end_error_ms"] for r in rows]
    later = [r["start_error_ms"] for k, r in enumerate(rows) if k > 0 and rows[k - 1]["item"] == r["item"]]
    both = [e for pair in zip(starts, ends, strict=True) for e in pair]
    return {
        "all": summary(both),
        "starts": summary(starts),
        "ends": summary(ends),
        "starts after the first word": summary(later),
    }


def run(model) -> dict:
    """Every number of the benchmark (see the module docstring)."""
    test = speech_data.test_set()
    valid = [speech_data.sentence(s) for s in VALIDATION_SEEDS]
    said = model.transcribe([s.audio for s in test])
    exact = sum(a == s.text for a, s in zip(said, test, strict=True))
    cache = capture(model, test)
    per_head = probe.word_timestamps(cache, gold=gold(test))
    auto = probe.word_timestamps(cache)
    chosen_on_valid = probe.word_timestamps(capture(model, valid), gold=gold(valid)).chosen
    rows = {
        f"heads chosen without gold ({', '.join(f'{a}.{b}' for a, b in auto.chosen)})": split(
            probe.word_timestamps(cache, heads=auto.chosen, gold=gold(test))
        ),
        f"heads chosen with gold on validation ({', '.join(f'{a}.{b}' for a, b in chosen_on_valid)})": split(
            probe.word_timestamps(cache, heads=chosen_on_valid, gold=gold(test))
        ),
    }
    heads = [
        {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "chosen"}
        for r in per_head.heads.rows
    ]
    return {
        "sentences": len(test),
        "words": sum(len(s.words) for s in test),
        "transcribed_exactly": exact,
        "sets": rows,
        "heads": heads,
    }


def tables(result: dict) -> tuple[Table, Table]:
    """(the head sets split by boundary kind, every head alone) as probe Tables."""
    sets = [
        {"heads": name, "which boundaries": kind, **nums}
        for name, parts in result["sets"].items()
        for kind, nums in parts.items()
    ]
    return Table(sets, title="word boundaries, held-out sentences"), Table(
        result["heads"], title="each head alone"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="also write every number as JSON")
    args = parser.parse_args(argv)
    result = run(models.load("speech"))
    print(
        f"{result['sentences']} held-out sentences, {result['words']} words; transcribed exactly: "
        f"{result['transcribed_exactly']}/{result['sentences']}"
    )
    sets, heads = tables(result)
    print(sets.to_text(max_rows=100))
    print()
    print(heads.to_text(max_rows=100))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
