"""One role's rollouts (queries, negatives or positives of Eq. 4), one row each."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class RolloutBatch:
    """Rollouts of one role (queries, negatives or positives), one row each."""

    prompt_ids: list[list[int]]  # templated prompt, unpadded
    instruction_lengths: list[int]  # L_sys of each prompt
    rationale_ids: list[list[int]]  # the rationale, EOS excluded
    stop_ids: list[int]  # EOS id that ended the rationale; −1 when it hit the length limit
    embeddings: Tensor  # (R, H) h of Eq. 3, L2-normalised
    truncated: Tensor  # (R,) bool, no EOS within the limit (Eq. 28)
    temperature: float
    budgets: list[int] = field(default_factory=list)  # each row's rationale budget (0: the prompt alone)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def lengths(self) -> Tensor:
        return torch.tensor([len(r) for r in self.rationale_ids], dtype=torch.float32)

    @property
    def prompt_lengths(self) -> Tensor:
        return torch.tensor([len(p) for p in self.prompt_ids], dtype=torch.float32)
