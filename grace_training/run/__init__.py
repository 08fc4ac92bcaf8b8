"""What keeps a run safe: checkpoints and resume, the run folder, Hub pushes, processes, the metrics log."""
