"""A data-parallel sampler whose position is part of the migrated state.

Each rank reads a disjoint shard of a seeded per-epoch permutation. The sampler's
state (rank, epoch, offset) is small and exact, so a joiner that loads the leaver's
state reads precisely the batches the leaver would have read, and a rank rebuilt
after a failure can be positioned at the start of the step that failed.
"""

from __future__ import annotations

from typing import Any

import torch


class ResumableSampler:
    """Yields batches of dataset indices for one data-parallel rank.

    ``rank`` and ``world_size`` are part of the state: a standby constructs its
    sampler with any rank and receives the real one with the leaver's state.
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if dataset_len < batch_size * world_size:
            raise ValueError("dataset too small for one global batch")
        self.dataset_len = dataset_len
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0  # batches of this epoch already taken
        self._order: torch.Tensor | None = None

    @property
    def batches_per_epoch(self) -> int:
        return self.dataset_len // (self.batch_size * self.world_size)

    def _epoch_order(self) -> torch.Tensor:
        if self._order is None:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed + self.epoch)
                self._order = torch.randperm(self.dataset_len, generator=gen)
            else:
                self._order = torch.arange(self.dataset_len)
        return self._order

    def next_batch(self) -> list[int]:
        """The indices of this rank's next batch; advances the position."""
        if self.offset >= self.batches_per_epoch:
            self.epoch += 1
            self.offset = 0
            self._order = None
        order = self._epoch_order()
        global_batch = self.batch_size * self.world_size
        start = self.offset * global_batch + self.rank * self.batch_size
        self.offset += 1
        return [int(i) for i in order[start : start + self.batch_size]]

    def state_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any], /) -> None:
        if state["epoch"] != self.epoch or state["seed"] != self.seed:
            self._order = None
        self.rank = int(state["rank"])
        self.world_size = int(state["world_size"])
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self.seed = int(state["seed"])
