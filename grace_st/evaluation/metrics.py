"""Metrics the package itself reports (training's evaluation); the scoreboard's others are in benchmarks/."""

from __future__ import annotations

import numpy as np


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation of two score lists, as STS tasks report it."""
    from scipy.stats import spearmanr

    return float(spearmanr(x, y).statistic)
