"""Masked mean pooling over the non-instruction span (method.md §1, Eq. 3)."""

from __future__ import annotations

import torch
from torch import Tensor


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
