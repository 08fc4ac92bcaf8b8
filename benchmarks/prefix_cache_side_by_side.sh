#!/usr/bin/env bash
# The instruction prefix cache off and on, side by side in one run (about 10 minutes on a quiet 2-core CPU):
# one query's p50 at the shipped query budget, encode's texts/s, and the server at 1, 8, 32 and 64 clients with
# work% against the matmul peak measured in the same run, float32 and int8, for queries (the shipped query budget)
# and plain texts (the shipped default budget). Results in benchmarks/results/.
#
#     bash benchmarks/prefix_cache_side_by_side.sh            # THREADS=2 by default
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS="${THREADS:-2}"
PY="${PYTHON:-python}"
OUT=benchmarks/results
$PY benchmarks/latency.py --weights float32 int8 --budgets 0 --queries 40 --threads "$THREADS" \
    --prefix-cache off on --out "$OUT/prefix_cache_latency.json"
$PY benchmarks/encode_throughput.py --batch-sizes 1 64 --rationale-tokens 0 --texts 128 --no-two-pass \
    --threads "$THREADS" --prefix-cache off on --out "$OUT/prefix_cache_encode_throughput.json"
$PY benchmarks/serve_load.py --weights float32 int8 --mixes query text --clients 1 8 32 64 --requests 64 \
    --seconds 30 --soak 0 --prefix-cache off on --output "$OUT/prefix_cache_serve_load.json"
