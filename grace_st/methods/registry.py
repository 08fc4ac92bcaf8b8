"""The methods a :class:`~grace_st.encoder.GenerativeEncoder` thinks with, by their saved ``method`` setting."""

from __future__ import annotations

from grace_st.methods.gircse import SoftTokenEngine
from grace_st.methods.grace import RationaleEngine
from grace_st.methods.grc import LatentEngine

ENGINES = {"grace": RationaleEngine, "gircse": SoftTokenEngine, "grc": LatentEngine}
