"""The ways a model thinks before it embeds, one module each (GRACE, GIRCSE, GRC) with its record
(:class:`~grace_st.methods.base.Method`), and the registry the encoder reads its ``method`` setting from."""

from grace_st.methods.base import LearnedState, Method
from grace_st.methods.gircse import SoftTokenEngine
from grace_st.methods.grace import RationaleEngine, length_buckets
from grace_st.methods.grc import LatentEngine
from grace_st.methods.registry import ENGINES, METHODS, method_record, register, unregister

__all__ = [
    "ENGINES",
    "METHODS",
    "LatentEngine",
    "LearnedState",
    "Method",
    "RationaleEngine",
    "SoftTokenEngine",
    "length_buckets",
    "method_record",
    "register",
    "unregister",
]
