"""Zero-filled pattern storage from anonymous memory maps backed by transparent huge pages.

An in-memory capture allocates one fresh pattern block per layer (48 MB for GPT-2 small at
T = 1024). From the C allocator each block is a new mapping whose 4 KB pages are faulted in one
by one on first touch: ~12 000 page faults per layer, paid again by every capture. Mapped here
with ``MADV_HUGEPAGE``, the kernel faults the block in 2 MB pages instead (about 500x fewer
faults), and since a fresh anonymous map is zero-filled, the recompute can skip zeroing the keys
a causal query never sees. The map belongs to the tensor's storage: it is unmapped the moment
the last tensor using it dies, so a dropped cache returns its memory at once.

Only for CPU tensors on systems whose ``mmap`` has ``MADV_HUGEPAGE`` (Linux); elsewhere
:func:`zeroed` returns None and the caller allocates as usual.
"""

from __future__ import annotations

import math
import mmap

import torch

# below this a block comes from the C allocator's reused heap anyway (no fresh pages to fault)
MIN_BYTES = 4 << 20
_HUGE = 2 << 20
AVAILABLE = hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS")
# Off by default: measured slower in three of four runs. HF GPT-2 at T = 1024, default
# allocator, in-memory capture, interleaved in one process (benchmarks/switch_ab.py --switch
# arena, 5 rounds): 1.43x / 1.39x / 1.51x the plain forward with the arena, 1.20x / 1.15x / 1.21x
# without; a later, slower phase of the machine gave 1.36x with it, 1.52x without. On that
# virtual machine a round of huge-page faults sometimes took up to 25x its usual time with no
# compaction stall counted by the kernel (benchmarks/costs.py --parts pages): the cost lies
# outside the guest, so it cannot be predicted from here.
# Set ``probe.capture.arena.ENABLED = True`` to use it.
ENABLED = False


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor | None:
    """A zero-filled contiguous ``shape`` tensor on a fresh huge-page map, or None where not worth it.

    None for non-CPU devices, small blocks, platforms without ``MADV_HUGEPAGE``, or when the map
    cannot be made (the caller then allocates with ``torch.empty`` and zeroes what it must).
    """
    if not (ENABLED and AVAILABLE) or torch.device(device).type != "cpu":
        return None
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < MIN_BYTES:
        return None
    size = -(-nbytes // _HUGE) * _HUGE
    try:
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return None
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # huge pages switched off: still a zero-filled map, faulted 4 KB at a time
    # the tensor's storage holds a reference to the map; the map is unmapped when it dies
    return torch.frombuffer(m, dtype=dtype, count=math.prod(shape)).view(shape)
