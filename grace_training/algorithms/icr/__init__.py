"""GIRCSE's iterative contrastive refinement (``gircse.md`` §3)."""

from grace_training.algorithms.base import Algorithm
from grace_training.algorithms.grpo import POLICY_KEYS

ALGORITHM = Algorithm(
    name="icr",
    method="gircse",
    summary="GIRCSE: K soft tokens (K = `max_rationale_tokens` by prompt type) trained end to end by Iterative "
    "Contrastive Refinement, Eq. 7's InfoNCE at every step (CoSENT for an `sts` source) + λ · Eq. 8",
    step="grace_training.algorithms.icr.step:ICRStep",
    label="GIRCSE (ICR)",
    config_keys=("icr_temperature", "icr_lambda"),
    refused_keys=POLICY_KEYS,
    embedding_loss=True,
    prompt_formats=("chat", "instruct"),  # instruct: GIRCSE's reference string
)
