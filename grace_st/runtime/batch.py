"""The batch tensors and data classes every method shares: how rows of token ids become a padded batch,
which positions Eq. 3 pools, and the records that cross :class:`~grace_st.methods.RationaleEngine`.

``encode``, the server's scheduler, the rationale cache and training (GRPO, its hybrid term, GIRCSE's ICR,
the InfoNCE yardstick) all build their batches here, so a prompt is padded, positioned and pooled one way
whichever path embeds it:

- records: :class:`Rationales` (what every generator returns), :class:`Rollouts` (rationales with the
  hidden states they were decoded with), :class:`RolloutRequest` (what to think about) and
  :class:`Thoughts` (what the engine thought);
- padding: :func:`left_pad` (prompts: generation continues at the right edge), :func:`right_pad` (whole
  sequences: positions start at 0 as unpadded), :func:`pad_rationales`;
- positions: :func:`position_ids_from_mask`, :func:`prompt_pooling_mask` (t > L_sys);
- Eq. 3: :func:`masked_mean`, the one pooling function of the package (method.md §1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor


class Rationales(NamedTuple):
    """The rationale contract: what every generator gives, one row a prompt, in order. The HF
    one-pass rollout (:meth:`Rollouts.rationales`) and vLLM
    (:meth:`grace_st.runtime.vllm_backend.VLLMRationaleGenerator.generate`) both return it, and encode and
    training read it the same way whichever made it."""

    rationale_ids: list[list[int]]  # the rationale r (Eq. 1), its EOS excluded
    stop_ids: list[int]  # the EOS id that ended it (part of the action scored in Eq. 11); -1 if none
    truncated: list[bool]  # hit the length limit without an EOS (Eq. 28)


@dataclass
class Rollouts:
    """Generated rationales with the hidden states of ``P(x) ⊕ r``.

    The prompt part is left-padded, the rationale part right-padded: column ``N + k`` holds
    rationale token ``k`` of every row.
    """

    attention_mask: Tensor  # (B, N + G) 1 on real tokens, EOS excluded
    pooling_mask: Tensor  # (B, N + G) 1 where Eq. 3 pools: t > L_sys, before EOS, not padding
    token_embeddings: Tensor  # (B, N + G, H) hidden states of the chosen layer
    rationale_ids: Tensor  # (B, G) rationale token ids, -1 after the rationale ends
    truncated: Tensor  # (B,) hit the length limit without EOS (Eq. 28's length penalty)
    stop_ids: Tensor  # (B,) the EOS token that ended each rationale, -1 where none did

    def rationales(self) -> Rationales:
        """The rationales alone, in the contract every generator meets."""
        ids = [[t for t in row if t >= 0] for row in self.rationale_ids.tolist()]
        return Rationales(ids, [int(t) for t in self.stop_ids.tolist()], [bool(t) for t in self.truncated.tolist()])


@dataclass
class RolloutRequest:
    """Rows to think about: prompts ``P(x)`` (token ids, unpadded) and their L_sys, one temperature for
    every row or one a row (0: greedy), a sampling seed a row (None: torch's global generator), and
    the shared top-p and rationale budget (0: the prompt alone is pooled), and the repetition penalty
    over each rationale's own tokens (1: none; :func:`~grace_st.runtime.generation.penalise_repeats`)."""

    prompt_ids: list[list[int]]
    instruction_lengths: list[int]
    temperatures: float | Sequence[float]
    top_p: float
    max_new_tokens: int
    seeds: list[int] | None = None
    repetition_penalty: float = 1.0
    # the prompts already left-padded, (input_ids, attention_mask) of every row in order, when the caller has
    # them (``encode``'s batch): a pass over all the rows uses them instead of padding the prompts again
    padded: tuple[Tensor, Tensor] | None = None

    def __post_init__(self) -> None:
        self.temperatures = per_row(self.temperatures, len(self.prompt_ids))


@dataclass
class Thoughts:
    """What :meth:`RationaleEngine.generate` returns, row by row as requested: the rationales and, from a
    backend that has them, the hidden states they were decoded with (``chunks``: the rows of each
    generating pass and its :class:`~grace_st.runtime.generation.Rollouts`), which :meth:`RationaleEngine.embed`
    pools instead of running a second pass."""

    rationales: Rationales
    chunks: list[tuple[list[int], Rollouts]] = field(default_factory=list)

    def single_pass(self) -> Rollouts | None:
        """The states of all rows in request order when one pass made them (``encode``'s batches),
        for the per-token outputs; else None."""
        if len(self.chunks) == 1 and self.chunks[0][0] == list(range(len(self.rationales.rationale_ids))):
            return self.chunks[0][1]
        return None


def per_row(value: float | Sequence[float], rows: int, name: str = "temperatures") -> list[float]:
    """One value for every row, or one a row (checked: as many as rows, each >= 0)."""
    values = [float(value)] * rows if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != rows:
        raise ValueError(f"{len(values)} {name} for {rows} prompts")
    if any(not v >= 0 for v in values):
        raise ValueError(f"{name} must be >= 0, got {values}")
    return values


def left_pad(rows: Sequence[Sequence[int]], pad_token_id: int) -> tuple[Tensor, Tensor]:
    """Token rows left-padded to the longest (a prompt batch: every row ends where generation starts), and their
    attention mask."""
    width = max((len(row) for row in rows), default=0)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, width - len(row) :] = 1
    return input_ids, attention_mask


def right_pad(rows: Sequence[Sequence[int]], pad_token_id: int, device=None) -> tuple[Tensor, Tensor]:
    """Token rows right-padded to the longest, and their attention mask: positions start at 0 in every row, as in
    an unpadded pass, and a causal model's real tokens never see the padding after them."""
    width = max((len(row) for row in rows), default=0)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long, device=device)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.as_tensor(row, dtype=torch.long, device=device)
        attention_mask[i, : len(row)] = 1
    return input_ids, attention_mask


def pad_rationales(groups: list[list[list[int]]], repeats: int) -> Tensor:
    """(texts, repeats, longest) rationale ids, -1 after each rationale's end."""
    width = max((len(ids) for group in groups for ids in group), default=0)
    padded = torch.full((len(groups), repeats, width), -1, dtype=torch.long)
    for i, group in enumerate(groups):
        for k, ids in enumerate(group):
            padded[i, k, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return padded


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions for a left-padded batch: 0 at each row's first real token."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def prompt_pooling_mask(attention_mask: Tensor, instruction_lengths: Tensor) -> Tensor:
    """Positions t > L_sys of each left-padded prompt (Eq. 3)."""
    width = attention_mask.shape[1]
    first_pooled = (width - attention_mask.sum(1)) + instruction_lengths
    return torch.arange(width, device=attention_mask.device)[None, :] >= first_pooled[:, None]


def masked_mean(token_embeddings: Tensor, mask: Tensor) -> Tensor:
    """h = mean of E_t over positions where ``mask`` is set (t > L_sys, real tokens) (Eq. 3).

    Masked positions are selected out rather than multiplied by zero: a padded position's
    state may be non-finite, and 0 · NaN would poison the mean. Summed in float32 whatever the
    model's dtype, one position after another (a running sum, ``cumsum``): a masked position adds
    an exact 0, so a text's mean is the same bits however much padding its batch gives it, where
    ``sum``'s blocked reduction regroups the terms as the padding shifts them.
    """
    mask = mask.bool()
    if token_embeddings.shape[1] == 0:
        return token_embeddings.new_zeros((token_embeddings.shape[0], token_embeddings.shape[-1]), dtype=torch.float32)
    summed = torch.where(mask[..., None], token_embeddings.float(), 0.0).cumsum(1)[:, -1]
    counts = mask.sum(1, keepdim=True).clamp(min=1)
    return summed / counts
