"""GRC's generation, reconstruction and representation losses (``grc.md`` Eq. 5)."""
