"""GRC's generation, reconstruction and representation losses (``grc.md`` Eq. 5)."""

from grace_training.algorithms.base import Algorithm
from grace_training.algorithms.grpo import POLICY_KEYS

ALGORITHM = Algorithm(
    name="grc",
    method="grc",
    summary="GRC: meta latent tokens, Eq. 5 (α L_Gen + β L_Recons + γ L_Rep) in one masked forward a text; the saved "
    "model answers, then embeds with its latents",
    step="grace_training.algorithms.grc.step:GRCStep",
    label="GRC",
    config_keys=(
        "num_latent_tokens", "grc_alpha", "grc_beta", "grc_gamma", "grc_scale", "max_reconstruction_tokens",
        "grc_response_targets",
    ),
    refused_keys=POLICY_KEYS,
    embedding_loss=True,
)
