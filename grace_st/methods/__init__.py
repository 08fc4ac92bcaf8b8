"""The ways a model thinks before it embeds, one module each (GRACE, GIRCSE, GRC), and the registry the
encoder reads its ``method`` setting from."""

from grace_st.methods.gircse import SoftTokenEngine
from grace_st.methods.grace import RationaleEngine, length_buckets
from grace_st.methods.grc import LatentEngine
from grace_st.methods.registry import ENGINES

__all__ = ["ENGINES", "LatentEngine", "RationaleEngine", "SoftTokenEngine", "length_buckets"]
