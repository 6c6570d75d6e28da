"""Retrain a zoo model deterministically and save its checkpoint.

python -m models.train minigpt
python -m models.train translator --out /tmp/translator.safetensors
"""

from __future__ import annotations

import argparse

from . import CONVERTED, SHIPPED, names, train_and_save


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m models.train",
        description="Retrain a zoo model with its deterministic recipe, print the loss "
        "progression, the final loss and the seconds it took, and save the weights as "
        "safetensors (atomically).",
    )
    trainable = [n for n in names() if n not in CONVERTED]  # smollm2 is converted, not trained
    parser.add_argument("name", choices=trainable, help="the zoo model to train")
    parser.add_argument(
        "--out",
        metavar="PATH",
        help="where to write the checkpoint (default: models/checkpoints/NAME.safetensors for "
        f"{', '.join(SHIPPED)}; the cache directory for the others)",
    )
    args = parser.parse_args(argv)

    _, stats, path = train_and_save(args.name, args.out, log=print)
    final = "n/a (not trained)" if stats.final_loss is None else f"{stats.final_loss:.6f}"
    print(f"final loss {final} after {stats.steps} steps in {stats.seconds:.1f} s")
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
