"""Which layout of a float32 weight a linear layer's product reads fastest, by rows a call.

Batch-1 decoding (a search box's ``encode_query``) multiplies one row by every weight matrix, so its
speed is how fast the kernel streams the weight. For each of SmolLM2-135M's linear shapes (q/o
576 × 576 and k/v 192 × 576 are covered by the first two's bandwidth; gate/up 1536 × 576, down
576 × 1536, the LM head 49152 × 576) and each row count, the same product three ways:

- ``packed``: oneDNN on the weight reordered into its blocked layout (grace_st.packed_linear, what
  ``encode`` used for every call before the one-row layout);
- ``transposed``: ``torch.mm(x, Wᵀ)`` with ``Wᵀ`` stored contiguous (in × out; the one-row layout);
- ``F.linear``: PyTorch's default path (MKL on the weight as stored).

Cache-cold, as in a decoding step: each call takes the next of enough distinct matrices to fill
about 200 MB, so no weight is in a cache when it is read. Best of three sweeps. GB/s is the
weight's bytes over the call's time, beside the machine's read bandwidth (a sum over 512 MB).

    python benchmarks/row_vector_kernel.py                    # JSON: benchmarks/results/row_vector_kernel.json
    python benchmarks/row_vector_kernel.py --threads 1 --rows 1 8 64
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F
from latency import read_bandwidth  # benchmarks/latency.py, beside this script

from grace_st.scoreboard import write_json

SHAPES = {
    "q/o 576x576": (576, 576), "k/v 192x576": (192, 576), "gate/up 1536x576": (1536, 576), "down 576x1536": (576, 1536),
    "LM head 49152x576": (49152, 576),
}


def time_kernels(out_features: int, in_features: int, rows: list[int], pool_mb: int = 200) -> list[dict]:
    count = max(2, pool_mb * 2**20 // (4 * out_features * in_features))
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out_features, in_features, generator=generator) for _ in range(count)]
    layouts = {
        "packed": [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights],
        "transposed": [w.t().contiguous() for w in weights],
        "F.linear": weights,
    }
    products = {
        "packed": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        "transposed": torch.mm,
        "F.linear": F.linear,
    }
    results = []
    for row_count in rows:
        x = torch.randn(row_count, in_features, generator=generator)
        for kernel, product in products.items():
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                for weight in layouts[kernel]:
                    product(x, weight)
                best = min(best, (time.perf_counter() - start) / count)
            results.append({
                "shape": [out_features, in_features], "rows": row_count, "kernel": kernel, "us": best * 1e6,
                "GBps": 4 * out_features * in_features / best / 1e9,
            })
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 16, 64])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default="benchmarks/results/row_vector_kernel.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth()
    report = {
        "threads": args.threads, "machine": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "read_bandwidth_GBps": bandwidth / 1e9, "rows": [],
    }
    print(f"{args.threads} threads, {report['cpu_capability']}; read bandwidth {bandwidth / 1e9:.1f} GB/s")
    for name, shape in SHAPES.items():
        for row in time_kernels(*shape, args.rows):
            report["rows"].append({"layer": name, **row})
            write_json(report, args.out)
            print(json.dumps(report["rows"][-1]))
    print("\n| layer | rows | packed µs | transposed µs | F.linear µs | transposed / packed | transposed GB/s |")
    print("|---|---|---|---|---|---|---|")
    by_cell: dict = {}
    for row in report["rows"]:
        by_cell.setdefault((row["layer"], row["rows"]), {})[row["kernel"]] = row
    for (layer, rows), cell in by_cell.items():
        print(
            f"| {layer} | {rows} | {cell['packed']['us']:.0f} | {cell['transposed']['us']:.0f} | "
            f"{cell['F.linear']['us']:.0f} | {cell['transposed']['us'] / cell['packed']['us']:.2f} | "
            f"{cell['transposed']['GBps']:.1f} |"
        )


if __name__ == "__main__":
    main()
