"""Where a trained vision transformer looks: the zoo's ViT on a picture whose object box is known.

``models.shapes`` draws a shape (circle, square, triangle, cross, ring, diamond) on a textured,
noisy background and returns the object's box; the zoo's ``vit_zoo`` was trained to name the
shape. This script captures the model on one picture through its own processor (the way a
Hugging Face image processor is called), lays the class token's attention on the 8 x 8 patch
grid (``probe.attention_map``: the last layer's mean over heads, and attention rollout), plays the
pointing game against the box (``probe.pointing``: does the map's peak fall on the object?) and
saves the picture with the class token's map of every layer and rollout over it, the box in cyan.

    python examples/vit_pointing.py                 # about 10 s on 2 cores
    python examples/vit_pointing.py --seed 7 --out other.png

``benchmarks/pointing_zoo.py`` plays the same game on hundreds of held-out pictures, per map kind.
"""

from __future__ import annotations

import argparse

from matplotlib.patches import Rectangle

import models
import probe
from models import shapes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=3, help="which generated picture")
    ap.add_argument("--out", default="vit_pointing.png", help="where the figure goes")
    a = ap.parse_args()

    vit = models.load("vit_zoo")
    data = shapes.generate(1, seed=a.seed)
    picture, box = shapes.to_pil(data.images[0]), data.boxes[0].tolist()
    shape, said = shapes.CLASSES[int(data.labels[0])], vit.classify([picture])[0]
    print(f"picture {a.seed}: a {shape} in box {box}; the model says {said}")

    cache = probe.capture(vit, [picture], processor=vit.processor)
    grid = cache.metadata["stacks"]["encoder"]["positions"]["grid"]
    first = ", ".join(cache.tokens[0][:4])
    print(f"positions: {first}, ... ({grid['rows']}x{grid['cols']} patches of {grid['patch'][0]} px)")
    last = vit.config.n_layer - 1
    maps = {
        "last-layer [CLS]": probe.attention_map(cache, last),
        "rollout": probe.attention_map(cache, last, query="rollout"),
    }
    game = probe.pointing(maps, box, image=tuple(grid["image"]))
    for row in game.table:
        print(
            f"{row['map']:>16}: peak at patch {tuple(row['peak'])}, "
            f"{'on' if row['hit'] else 'off'} the object, {row['mass_inside']:.0%} of the map in its box"
        )

    fig = probe.plot.image_layers(cache, picture=picture)  # [CLS] per layer, then rollout
    x0, y0, x1, y1 = box
    for ax in fig.axes:
        if ax.images:  # the panels (not the empty ones)
            ax.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, ec="cyan", lw=1.5))
    fig.savefig(a.out, dpi=100)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
