"""grace-st: generative embeddings (GRACE) as a sentence-transformers model.

A causal LM writes a rationale about a text, then its own hidden states over the
instruction-wrapped text and the rationale are mean-pooled into the embedding
(``docs/method.md`` §1, Eqs. 1–3).
"""

from __future__ import annotations

from .build import from_causal_lm
from .default_model import default_model_path
from .encoder import GenerativeEncoder
from .explain import explain
from .loading import load
from .prompts import DEFAULT_INSTRUCTIONS

__version__ = "0.4.0"
__all__ = ["DEFAULT_INSTRUCTIONS", "GenerativeEncoder", "default_model_path", "explain", "from_causal_lm", "load"]
