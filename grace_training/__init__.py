"""grace_training: trains a generative embedding model: GRACE by GRPO with contrastive rewards, GIRCSE by
iterative contrastive refinement (ICR), GRC by its generation, reconstruction and representation losses, and the
InfoNCE yardstick (``algorithms/``, one folder each), on a loop with crash-safe checkpoints and resume (``run/``)."""

from grace_st import moved_modules

moved_modules.install()
