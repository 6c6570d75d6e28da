"""The pointing game (Zhang et al. 2016) of the zoo's vision transformer, per kind of attention map.

    python benchmarks/pointing_zoo.py              # the shipped vit_zoo checkpoint
    python benchmarks/pointing_zoo.py --n 600 --checkpoint other.safetensors

Held-out pictures from models.shapes (seeds the training never draws: training batches use seeds
from seed * 100000 + 1), two splits: `validation` chooses the best single head (layer, head) by
its hit rate, `test` reports every map kind. The model is captured with probe.capture on
{"pixel_values": ...}; each map is probe.attention_map of the cache (the class token's row, laid
on the 8 x 8 patch grid); probe.pointing scores it against the object's box (a hit when the peak
patch's centre lies inside the box) and its mask (inside the object's own pixels), and gives the
share of the map's mass inside the box. `random patch` is what a map with its peak on a random
patch would score: the mean share of patch centres inside the box (or mask).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import models  # noqa: E402
import probe  # noqa: E402
from models import shapes, vit_zoo  # noqa: E402
from probe.analysis.table import Table  # noqa: E402

VALIDATION_SEED, TEST_SEED = 20_000, 30_000


def load(path: str | None) -> vit_zoo.VisionTransformer:
    """The shipped model, or the checkpoint at ``path``."""
    if path is None:
        return models.load("vit_zoo")
    state, meta = models.checkpoint.read(path)
    model = vit_zoo.from_config(meta["config"])
    model.load_state_dict(state)
    return model.eval()


def maps_of(
    model: vit_zoo.VisionTransformer, data: shapes.Shapes, batch: int = 100
) -> dict[str, torch.Tensor]:
    """``{map name: [n, rows, cols]}``: per layer and head the class token's map, the last layer's
    head mean (``last [CLS] mean``) and rollout up to the last layer (``rollout``)."""
    last = model.config.n_layer - 1
    out: dict[str, list[torch.Tensor]] = {}
    for start in range(0, len(data), batch):
        x = vit_zoo.normalise(data.images[start : start + batch], model.config)
        cache = probe.capture(model, {"pixel_values": x})
        for b in range(x.shape[0]):
            named = {
                "last [CLS] mean": probe.attention_map(cache, last, batch=b),
                "rollout": probe.attention_map(cache, last, query="rollout", batch=b),
            }
            for layer in range(model.config.n_layer):
                for head in range(model.config.n_head):
                    named[f"L{layer} H{head}"] = probe.attention_map(cache, layer, head, batch=b)
            for k, v in named.items():
                out.setdefault(k, []).append(v)
    return {k: torch.stack(v) for k, v in out.items()}


def chance(objects, rows: int, cols: int, size: int) -> float:
    """The mean share of patch centres inside the objects: a random peak's hit rate."""
    ys = ((torch.arange(rows) + 0.5) * size / rows).long()
    xs = ((torch.arange(cols) + 0.5) * size / cols).long()
    return float(torch.stack([m[ys][:, xs].float().mean() for m in objects]).mean())


def box_masks(data: shapes.Shapes, size: int) -> torch.Tensor:
    """The objects' boxes as masks (the pixels whose centre is inside the box)."""
    from probe.analysis.pointing import object_mask

    return torch.stack([object_mask(box.tolist(), (size, size)) for box in data.boxes])


def table(model: vit_zoo.VisionTransformer, n: int) -> tuple[Table, str]:
    """The pointing game on the test split per map kind, and the best head chosen on validation."""
    size = model.config.image_size
    val, test = (
        shapes.generate(n, seed=VALIDATION_SEED, size=size),
        shapes.generate(n, seed=TEST_SEED, size=size),
    )
    val_maps = maps_of(model, val)
    heads = {k: v for k, v in val_maps.items() if k.startswith("L")}
    by_head = probe.pointing(heads, [b.tolist() for b in val.boxes], image=(size, size)).by_map
    best, best_val = by_head[0]["map"], by_head[0]["hit_rate"]
    test_maps = maps_of(model, test)
    boxes = [b.tolist() for b in test.boxes]
    rows = []
    kinds = {
        "last-layer [CLS] map, mean over heads": test_maps["last [CLS] mean"],
        "rollout (Abnar & Zuidema 2020)": test_maps["rollout"],
        f"best single head ({best}, chosen on validation)": test_maps[best],
    }
    for name, maps in kinds.items():
        on_box = probe.pointing(maps, boxes, image=(size, size)).by_map[0]
        on_mask = probe.pointing(maps, list(test.masks), image=(size, size)).by_map[0]
        rows.append(
            {
                "map": name,
                "hit rate (box)": round(on_box["hit_rate"], 3),
                "hit rate (mask)": round(on_mask["hit_rate"], 3),
                "mass in box": round(on_box["mass_inside"], 3),
            }
        )
    g = model.grid
    rows.append(
        {
            "map": "random patch (chance)",
            "hit rate (box)": round(chance(box_masks(test, size), g, g, size), 3),
            "hit rate (mask)": round(chance(test.masks, g, g, size), 3),
            "mass in box": round(float(box_masks(test, size).float().mean()), 3),
        }
    )
    with torch.no_grad():
        acc = float(
            (model(vit_zoo.normalise(test.images, model.config)).argmax(-1) == test.labels).float().mean()
        )
    note = (
        f"{n} test pictures (seed {TEST_SEED}); the best head chosen on {n} validation pictures "
        f"(seed {VALIDATION_SEED}), where it hit {best_val:.3f} (box); classification accuracy on "
        f"test {acc:.3f}"
    )
    return Table(rows, title="pointing game of vit_zoo on held-out pictures"), note


def main(argv: list[str] | None = None) -> int:
    """Print the table (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=300, help="pictures per split (default 300)")
    p.add_argument("--checkpoint", default=None, help="a vit_zoo checkpoint (default: the shipped one)")
    args = p.parse_args(argv)
    t, note = table(load(args.checkpoint), args.n)
    print(t.to_text(width=200))
    print(note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
