"""python -m grace_st.model_cards [methods]: the shipped models' dev scoreboard (their cards' table), or with
``methods`` the README's table of methods, to paste between its markers."""

import sys

from grace_st.model_cards import methods_table, results_table

print(methods_table() if sys.argv[1:] == ["methods"] else results_table(), end="")
