"""Attention layouts of their own, one file per family, mapped back to ``[query, key]`` (or refused).

:mod:`probe.capture.layouts.registry` holds the :class:`~probe.capture.layouts.registry.Layout`
interface and the registry the recorder dispatches through. Every module of this package is
imported here, and each registers its layouts when imported, so a new family is one new file:

* ``canine.py``: Canine's chunked local attention;
* ``depth.py``: Inkling2's softmax over earlier blocks (weights over depth, noted, not stored);
* ``compressed.py``: DeepSeek-V4's positions, compressed block summaries and sink in one softmax;
* ``ngram.py``: ProphetNet's main and predict streams;
* ``longt5.py``: LongT5's local blocks (its transient-global attention refused);
* ``pegasus_x.py``: Pegasus-X's blocks with global tokens;
* ``longformer.py``: Longformer's and LED's sliding window;
* ``reformer.py``: Reformer's local and LSH chunks, read at their ``logsumexp``;
* ``swin.py``: Swin's (shifted) windows over a picture's patch grid;
* ``spatial_heads.py``: ViTDet/SAM-style attention over a feature map, its softmax over
  ``[batch · heads, H·W, H·W]`` (batch first, read from the module's code; otherwise refused);
* ``fused.py``: torch's fused ``nn.MultiheadAttention`` and encoder layers, whose weights are
  recomputed after they return (the watcher runs them with its mode suspended, so there is no op
  to claim: the watcher and recorder call its functions by module type).
"""

from __future__ import annotations

import importlib
import pkgutil

from probe.capture.layouts.registry import LAYOUTS, Layout, on_sdpa, on_softmax, op_layout, register

for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")

# the torch ops other than softmax and SDPA that some layout reads (the watcher's mode hands them
# to the recorder inside the modules that claim them); a frozenset, as torch.compile traces the mode
OPS = frozenset(op for layout in LAYOUTS for op in layout.ops)

__all__ = ["LAYOUTS", "OPS", "Layout", "on_sdpa", "on_softmax", "op_layout", "register"]
