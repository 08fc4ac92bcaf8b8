"""grace-st: generative embeddings (GRACE) as a sentence-transformers model.

A causal LM writes a rationale about a text, then its own hidden states over the
instruction-wrapped text and the rationale are mean-pooled into the embedding
(``docs/method.md`` §1, Eqs. 1–3). The same module thinks in soft tokens (GIRCSE, ``docs/gircse.md``) or
reads learned latent tokens after its response, whose keys and values are also a compressed memory of the text
(GRC, ``docs/grc.md``: :func:`compress`, :func:`answer`).
"""

from __future__ import annotations

from grace_st.default_model import default_model_path
from grace_st.encoder import GenerativeEncoder
from grace_st.explain import explain
from grace_st.files.loading import load
from grace_st.from_causal_lm import from_causal_lm, from_gircse_adapter
from grace_st.memory import answer, compress
from grace_st import moved_modules
from grace_st.methods.grc import MemoryFileError, load_memories, save_memories
from grace_st.prompts import DEFAULT_INSTRUCTIONS

moved_modules.install()

__version__ = "0.12.0"
__all__ = [
    "DEFAULT_INSTRUCTIONS", "GenerativeEncoder", "MemoryFileError", "answer", "compress", "default_model_path",
    "encode_corpus", "explain", "from_causal_lm", "from_gircse_adapter", "load", "load_memories", "save_memories",
]


def __getattr__(name: str):
    # encode_corpus runs on Ray Data, an optional extra (grace-st[distributed]): its module imports Ray only
    # when called, and is itself imported only when asked for.
    if name == "encode_corpus":
        from grace_st.corpus import encode_corpus

        return encode_corpus
    raise AttributeError(f"module 'grace_st' has no attribute {name!r}")
