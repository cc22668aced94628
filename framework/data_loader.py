"""The training DataLoader that resumes mid-epoch: Lightning restores its position from a checkpoint.

It sits below both ``shardlight.data`` (which builds it) and ``shardlight.checkpoint`` (which writes its
position), so neither imports the other.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict

from torch.utils.data import DataLoader

SKIP_BATCHES = "skip_batches"


class _SkipOnce:
    """Index sampler view that drops the loader's pending ``skip`` batches on the next pass only."""

    def __init__(self, base: Any, loader: "ResumableDataLoader") -> None:
        self.base, self.loader = base, loader

    def __iter__(self):
        # Consumed when iterated, not when looked at: len() on the loader must not use up the skip.
        skip, self.loader._pending_skip = self.loader._pending_skip, 0
        return itertools.islice(iter(self.base), skip, None)

    def __len__(self) -> int:
        # The full length: Lightning adds the restored batch count to what the iterator yields.
        return len(self.base)


class ResumableDataLoader(DataLoader):
    """A DataLoader Lightning treats as stateful, so a resumed run continues mid-epoch where it stopped.

    The state (batches already consumed this epoch) is written by the checkpoint callback from the loop's
    own counters, not counted here: Lightning may prefetch, so an iterator count would be off by one.
    """

    _pending_skip = 0

    def state_dict(self) -> Dict[str, Any]:
        return {SKIP_BATCHES: 0}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._pending_skip = int(state.get(SKIP_BATCHES, 0))

    @property
    def _index_sampler(self):
        base = super()._index_sampler
        return _SkipOnce(base, self) if self._pending_skip else base
