"""Ranks under ``torchrun``: which process am I, and a barrier between all of them.

Ranks never exchange tensors: each writes its shard files, and rank 0 merges the statistics from
those files in shard order, so the result is bit-identical to a single-process run whatever the
number of ranks. ``torch.distributed`` (gloo: it runs everywhere, and only carries barriers here)
is used only when ``WORLD_SIZE`` > 1.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as td

from probe.errors import ProbeError


def rank_world() -> tuple[int, int]:
    """``(rank, world_size)`` from the environment ``torchrun`` sets; ``(0, 1)`` outside it."""
    try:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ProbeError("RANK / WORLD_SIZE are not integers; launch with torchrun or unset them") from None
    if world < 1 or not 0 <= rank < world:
        raise ProbeError(f"RANK={rank} is outside WORLD_SIZE={world}; launch with torchrun or unset them")
    return rank, world


class Group:
    """The process group of this run (joined on first use, left by :meth:`close`)."""

    def __init__(self) -> None:
        self.rank, self.world = rank_world()
        self._owned = False
        if self.world > 1 and not td.is_initialized():
            if not td.is_available():
                raise ProbeError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
            # a long timeout: rank 0 may merge many shards while the others wait at the barrier
            td.init_process_group("gloo", timeout=timedelta(hours=6))
            self._owned = True

    def barrier(self) -> None:
        """Wait until every rank got here (no-op in a single process)."""
        if self.world > 1:
            td.barrier()

    def mine(self, shard: int) -> bool:
        """Shards are dealt round-robin: shard ``i`` belongs to rank ``i mod world``."""
        return shard % self.world == self.rank

    def close(self) -> None:
        if self._owned and td.is_initialized():
            td.destroy_process_group()
