"""The InfoNCE yardstick (the paper's "w/ CL" row), trained through sentence-transformers' own trainer
(:func:`grace_training.algorithms.infonce.train.train_infonce`) rather than the loop: a reference to measure the
other algorithms against, not a fourth way to train."""

from grace_training.algorithms.base import Algorithm

ALGORITHM = Algorithm(
    name="infonce",
    method="grace",
    summary="the yardstick: InfoNCE on the prompt's pooled states (budget 0), through sentence-transformers' trainer",
    step=None,
    config_keys=("infonce_learning_rate", "infonce_batch_size", "infonce_temperature"),
    run_files=("final", "trainer", ".tmp-final", "metrics.jsonl", "tensorboard"),
)
