"""Single-threaded encode speed before and after the thread-safety change, side by side in one run.

The "before" package is a copy of grace_st/ taken before the change (``--before DIR``: a folder holding
``grace_st/``); each measurement runs in a fresh process that imports one copy or the other, and the two
alternate, ``--rounds`` times each. A measurement: the real default model (grace_st.default_model_path()),
``model.encode`` on 64 STS-like sentences at G=16 (batch 64), best of 3 after a warm-up, and 8
single-text ``encode_query`` calls (the one-row path). OMP_NUM_THREADS=1 throughout.

    OMP_NUM_THREADS=1 python lab/scripts/thread_safety_speed.py --before /tmp/before --after /tmp/after \
        --out lab/results/thread_safety_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

MEASURE = r"""
import hashlib, json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
import grace_st
from grace_st.scoreboard import sentences
from sentence_transformers import SentenceTransformer

torch.set_num_threads(1)
model = SentenceTransformer(grace_st.default_model_path(), trust_remote_code=True, device="cpu")
model[0].max_rationale_tokens = 16
pool, _ = sentences(8)
texts = [f"{a} {b}" for a in pool for b in pool][:64]  # 64 distinct texts (the built-in sentences, paired)
source = "64 distinct pairs of grace_st.scoreboard.sentences(8)"
model.encode(texts[:16], batch_size=64)  # warm-up: packing, the native step's binding
batch = []
for _ in range(3):
    start = time.perf_counter()
    embeddings = model.encode(texts, batch_size=64)
    batch.append(time.perf_counter() - start)
start = time.perf_counter()
queries = [model.encode_query([text]) for text in texts[:8]]
single = (time.perf_counter() - start) / 8
digest = hashlib.sha256(embeddings.tobytes() + b"".join(q.tobytes() for q in queries)).hexdigest()[:16]
print(json.dumps({"package": grace_st.__file__, "source": source, "encode_64_s": batch, "encode_64_best_s": min(batch),
                  "encode_query_one_text_s": single, "embeddings_sha256": digest}))
"""


def measure(package_root: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, package_root], cwd=package_root, env=env, check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a folder holding the unchanged copy of grace_st/")
    parser.add_argument(
        "--after", default=str(REPO),
        help="a folder holding the changed grace_st/ (default this checkout; a copy of --before with only the "
        "changed modules replaced keeps the package data, e.g. the shipped adapter's settings, the same)",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "lab" / "results" / "thread_safety_speed.json"))
    args = parser.parse_args()
    runs = []
    for round_ in range(args.rounds):
        order = [("before", args.before), ("after", args.after)]
        if round_ % 2:
            order.reverse()
        for label, root in order:
            result = measure(root)
            result.update(label=label, round=round_)
            print(json.dumps(result), flush=True)
            runs.append(result)
    summary = {}
    for label in ("before", "after"):
        mine = [r for r in runs if r["label"] == label]
        summary[label] = {
            "encode_64_best_s": sorted(r["encode_64_best_s"] for r in mine),
            "encode_64_best_of_rounds_s": min(r["encode_64_best_s"] for r in mine),
            "encode_query_one_text_s": sorted(r["encode_query_one_text_s"] for r in mine),
            "embeddings_sha256": sorted({r["embeddings_sha256"] for r in mine}),
        }
    report = {
        "what": "model.encode on 64 STS-like sentences at G=16 (batch 64, best of 3 a process) and single-text "
        "encode_query (mean of 8), real default model, OMP_NUM_THREADS=1; before/after alternate, a fresh process each; "
        "embeddings_sha256: a digest of the last batch's and the queries' embeddings (equal: the same bits)",
        "cpu_count": os.cpu_count(),
        "summary": summary,
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
