"""Which triplets a step trains on: the global batch of step s, a pure function of (seed, s).

Because the batch depends only on the step number, a resumed run sees exactly the batches a
straight run would, and every process computes the same global batch and takes its share.

- ``shuffled``: one seeded permutation of all triplets per epoch, cut into batches (the paper's
  loader; sources mix inside a batch).
- ``by_source``: each step draws one source with probability proportional to its weight
  (:func:`grace_training.data.examples.source_weights`) and takes that source's next B triplets from its
  own stream of seeded per-pass permutations. A batch is then one kind of text: short STS
  sentences no longer pad to a 128-token abstract in the update pass, the in-batch negatives of
  Eq. 7 and the hybrid term are of the same kind as the positive (harder), and a large source
  cannot drown a small one (the weights set the mix, not the sizes).
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Mapping, Sequence

SAMPLINGS = ("shuffled", "by_source")


class BatchSchedule:
    """Global batch indices into ``sources`` (each triplet's source name) for any step."""

    def __init__(
        self,
        sources: Sequence[str],
        batch_size: int,
        seed: int,
        sampling: str = "shuffled",
        weights: Mapping[str, float] | None = None,
    ) -> None:
        if sampling not in SAMPLINGS:
            raise ValueError(f"batch_sampling must be one of {SAMPLINGS}, got {sampling!r}")
        self.batch_size, self.seed, self.sampling = batch_size, seed, sampling
        self.size = len(sources)
        self._epoch_order: tuple[int, list[int]] | None = None
        by_source: dict[str, list[int]] = defaultdict(list)
        for index, name in enumerate(sources):
            by_source[name].append(index)
        self.members = dict(by_source)
        weights = dict(weights or {})
        self.names = [name for name in self.members if weights.get(name, len(self.members[name])) > 0]
        self.weights = [float(weights.get(name, len(self.members[name]))) for name in self.names]
        if sampling == "by_source":
            if not self.names:
                raise ValueError("batch_sampling: by_source: every source has weight 0")
            small = [f"{n} ({len(self.members[n])})" for n in self.names if len(self.members[n]) < batch_size]
            if small:
                raise ValueError(
                    f"batch_sampling: by_source needs at least batch_size={batch_size} triplets in each "
                    f"source drawn from; fewer in: {', '.join(small)} (give it weight 0 or merge it)"
                )
        self._draws: list[str] = []  # the source of steps 0, 1, ... (extended as asked)
        self._pass_order: dict[str, tuple[int, list[int]]] = {}

    def source_of(self, step: int) -> str:
        """The source step ``step`` draws from (``by_source``): a seeded choice by weight."""
        while len(self._draws) <= step:
            rng = random.Random(f"{self.seed}:source:{len(self._draws)}")
            self._draws.append(rng.choices(self.names, weights=self.weights)[0])
        return self._draws[step]

    def batch(self, step: int) -> list[int]:
        """The global batch of step ``step``: ``batch_size`` indices."""
        if self.sampling == "shuffled":
            return self._shuffled(step)
        name = self.source_of(step)
        start = sum(1 for drawn in self._draws[:step] if drawn == name) * self.batch_size
        return [self._stream(name, position) for position in range(start, start + self.batch_size)]

    def _shuffled(self, step: int) -> list[int]:
        steps_per_epoch = self.size // self.batch_size
        epoch, index = divmod(step, steps_per_epoch)
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            order = list(range(self.size))
            random.Random(self.seed + epoch).shuffle(order)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1][index * self.batch_size : (index + 1) * self.batch_size]

    def take(self, name: str, count: int) -> list[int]:
        """The first ``count`` indices of a source's stream (every triplet once before any repeats)."""
        return [self._stream(name, position) for position in range(count)]

    def _stream(self, name: str, position: int) -> int:
        """Position ``position`` of a source's endless stream: pass p is a seeded permutation of it."""
        members = self.members[name]
        passes, offset = divmod(position, len(members))
        if self._pass_order.get(name, (None,))[0] != passes:
            order = list(members)
            random.Random(f"{self.seed}:{name}:{passes}").shuffle(order)
            self._pass_order[name] = (passes, order)
        return self._pass_order[name][1][offset]
