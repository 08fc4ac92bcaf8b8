"""The model as the runtime sees it: one record of what every rollout, prompt pass and pooled pass reads from it.

An engine (:class:`~grace_st.methods.RationaleEngine`) builds its :class:`ModelView` once and hands it down whole, so
the decoder (:mod:`grace_st.runtime.decoding`), the rollouts (:mod:`grace_st.runtime.generation`), the second pass
(:mod:`grace_st.runtime.second_pass`) and training's pooled passes read the layer Eq. 3 pools, the pad and stop
ids, and the decode options from one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grace_st.runtime.decoding import DecodeOptions


@dataclass(frozen=True)
class ModelView:
    """A causal LM with what is read alongside it.

    Args:
        model: the causal LM (a PEFT model for a LoRA adapter).
        hidden_layer: the states Eq. 3 pools: -1 the decoder's final (normed) states, else an index into
            transformers' ``hidden_states``.
        pad_token_id: the id padding is written with (masked, never attended to).
        eos_token_ids: every id that ends a rationale (Eq. 1 stops at any).
        options: how the model is fed (:class:`~grace_st.runtime.decoding.DecodeOptions`: speed only).
    """

    model: object
    hidden_layer: int = -1
    pad_token_id: int = 0
    eos_token_ids: tuple[int, ...] = ()
    options: DecodeOptions = field(default_factory=DecodeOptions)

    def stop_ids(self, device) -> torch.Tensor:
        """The ids that end a rationale, sorted, as a tensor on ``device``."""
        return torch.tensor(sorted(set(self.eos_token_ids)), device=device)
