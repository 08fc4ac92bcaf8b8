"""GRPO with contrastive rewards (``method.md`` §2): rollouts, rewards, the clipped update."""

from grace_training.algorithms.base import Algorithm

# What this algorithm's policy update trains beyond Eq. 11; an algorithm with no policy term refuses them set.
POLICY_KEYS = ("contrastive_beta", "warm_start_steps", "kl_coef", "text_kl_coef", "ppo_epochs")

ALGORITHM = Algorithm(
    name="grpo",
    method="grace",
    summary="GRACE: rollouts, contrastive rewards, Eq. 11's clipped update and the hybrid terms; the model thinks in a "
    "written rationale",
    step="grace_training.algorithms.grpo.step:GRPOStep",
    label="GRACE (GRPO)",
    config_keys=(
        "num_rollouts", "temperature_positive", "temperature_query", "temperature_negative", "top_p",
        "rollout_batch_size", "rollout_bucket_ratio", "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size",
        "vllm_enable_sleep_mode", "reward_mode", "lambda_consistency", "lambda_hard_negative", "tau", "gamma",
        "length_penalty_mode", "length_penalty_units", "mask_truncated", "scale_rewards", "contrastive_temperature",
        "contrastive_anchors", "clip_epsilon", "share_prompt_pass", *POLICY_KEYS,
    ),
)
