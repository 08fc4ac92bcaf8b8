"""python -m grace_st.model_cards: the README's results table, to paste between its markers."""

from . import results_table

print(results_table(), end="")
