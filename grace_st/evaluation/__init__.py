"""Offline mteb evaluation: mteb task classes built from local files, and a runner.

```python
import mteb
from grace_st.evaluation import mteb_wrapper, retrieval_task, sts_task

tasks = [sts_task("stsb/dev.tsv", limit=200), retrieval_task("scifact", split="train", limit=50)]
results = mteb.evaluate(model, tasks, encode_kwargs={"batch_size": 16})
# with instructions of their own in model.prompts (mteb drops those of tasks outside its registry):
results = mteb.evaluate(mteb_wrapper(model, tasks), tasks, encode_kwargs={"batch_size": 16})
```

Needs the ``mteb`` extra (``pip install grace-st[mteb]``).
"""

from __future__ import annotations

from grace_st.evaluation import local_tasks
from grace_st.evaluation.local_tasks import *  # noqa: F403 -- the task classes and builders, listed in local_tasks.__all__
from grace_st.evaluation.runner import default_cache_dir, format_table, mteb_wrapper, run_evaluation

__all__ = [*local_tasks.__all__, "default_cache_dir", "format_table", "mteb_wrapper", "run_evaluation"]
