"""Which layout of a float32 weight a linear layer's product reads fastest, by rows a call.

Batch-1 decoding (a search box's ``encode_query``) multiplies one row by every weight matrix, so its
speed is how fast the kernel streams the weight. For each of SmolLM2-135M's linear shapes (q/o
576 × 576 and k/v 192 × 576 are covered by the first two's bandwidth; gate/up 1536 × 576, down
576 × 1536, the LM head 49152 × 576) and each row count, the same product three ways:

- ``packed``: oneDNN on the weight reordered into its blocked layout (grace_st.packed_linear, what
  ``encode`` used for every call before the one-row layout);
- ``transposed``: ``torch.mm(x, Wᵀ)`` with ``Wᵀ`` stored contiguous (in × out; the one-row layout);
- ``F.linear``: PyTorch's default path (MKL on the weight as stored).

With ``--two-workers`` (one row only) the product also runs on two Python threads of one intra-op thread
each, the question being whether a matrix-vector product can use both cores where MKL's and oneDNN's
stay near one core's bandwidth: ``halves (as stored)`` and ``halves (transposed)`` split the weight's
output features in two, one half a thread; ``two at once`` runs two different products of the shape
side by side (gate ∥ up, q ∥ k), each whole on its own thread, its µs the pair's time over two. Each
hand-off costs an event set and wait (tens of µs), which is what small weights pay.

Cache-cold, as in a decoding step: each call takes the next of enough distinct matrices to fill
about 200 MB, so no weight is in a cache when it is read. Best of three sweeps. GB/s is the
weight's bytes over the call's time, beside the machine's read bandwidth (a sum over 512 MB).

    python lab/scripts/row_vector_kernel.py                   # JSON: lab/results/row_vector_kernel.json
    python lab/scripts/row_vector_kernel.py --threads 1 --rows 1 8 64
    python lab/scripts/row_vector_kernel.py --threads 2 --rows 1 --two-workers --out lab/results/row_vector_two_workers.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from grace_st.scoreboard import write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from latency import read_bandwidth  # noqa: E402  (benchmarks/latency.py)

SHAPES = {
    "q/o 576x576": (576, 576), "k/v 192x576": (192, 576), "gate/up 1536x576": (1536, 576), "down 576x1536": (576, 1536),
    "LM head 49152x576": (49152, 576),
}


class SecondWorker:
    """A thread that runs one job while the caller runs another, and a barrier at the end of both."""

    def __init__(self):
        self.go, self.done, self.job = threading.Event(), threading.Event(), None
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            self.go.wait()
            self.go.clear()
            self.job()
            self.done.set()

    def both(self, mine, theirs) -> None:
        self.job = theirs
        self.go.set()
        mine()
        self.done.wait()
        self.done.clear()


TWO_WORKER_KERNELS = ("halves (as stored)", "halves (transposed)", "two at once")


def two_worker_products(weights: list, x, worker: SecondWorker) -> dict:
    """The one-row product on two threads, three ways (module docstring): kernel -> (sweep, products it makes)."""
    out_features = weights[0].shape[0]
    half = out_features // 2
    out = torch.empty(1, out_features)
    stored = [(w[:half].contiguous(), w[half:].contiguous()) for w in weights]
    transposed = [(w[:half].t().contiguous(), w[half:].t().contiguous()) for w in weights]
    # each whole product on the one-row layout encode uses for the shape (grace_st.packed_linear)
    whole = [w.t().contiguous() if out_features > w.shape[1] else w for w in weights]
    product = torch.mm if out_features > weights[0].shape[1] else F.linear

    def halves_stored():
        for a, b in stored:
            worker.both(lambda a=a: torch.mm(x, a.t(), out=out[:, :half]), lambda b=b: torch.mm(x, b.t(), out=out[:, half:]))

    def halves_transposed():
        for a, b in transposed:
            worker.both(lambda a=a: torch.mm(x, a, out=out[:, :half]), lambda b=b: torch.mm(x, b, out=out[:, half:]))

    def two_at_once():
        for a, b in zip(whole[0::2], whole[1::2]):
            worker.both(lambda a=a: product(x, a), lambda b=b: product(x, b))

    sweeps = (halves_stored, halves_transposed, two_at_once)
    counts = (len(weights), len(weights), len(weights) - len(weights) % 2)
    return dict(zip(TWO_WORKER_KERNELS, zip(sweeps, counts)))


def seconds_per_product(sweep, products: int) -> float:
    """Best of three sweeps, over the products a sweep makes."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        sweep()
        best = min(best, (time.perf_counter() - start) / products)
    return best


def time_kernels(
    out_features: int, in_features: int, rows: list[int], pool_mb: int = 200, worker: SecondWorker | None = None
) -> list[dict]:
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

    def record(row_count: int, kernel: str, seconds: float) -> None:
        results.append({
            "shape": [out_features, in_features], "rows": row_count, "kernel": kernel, "us": seconds * 1e6,
            "GBps": 4 * out_features * in_features / seconds / 1e9,
        })

    for row_count in rows:
        x = torch.randn(row_count, in_features, generator=generator)
        for kernel, product in products.items():

            def sweep(product=product, laid=layouts[kernel], x=x):
                for weight in laid:
                    product(x, weight)

            record(row_count, kernel, seconds_per_product(sweep, count))
        if worker is not None and row_count == 1:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # each of the two threads runs its products on its own core
            for kernel, (sweep, made) in two_worker_products(weights, x, worker).items():
                record(1, kernel, seconds_per_product(sweep, made))
            torch.set_num_threads(threads)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 16, 64])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--two-workers", action="store_true", help="also one row on two Python threads (docstring)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "row_vector_kernel.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth()
    report = {
        "threads": args.threads, "machine": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "read_bandwidth_GBps": bandwidth / 1e9, "rows": [],
    }
    print(f"{args.threads} threads, {report['cpu_capability']}; read bandwidth {bandwidth / 1e9:.1f} GB/s")
    worker = SecondWorker() if args.two_workers else None
    for name, shape in SHAPES.items():
        for row in time_kernels(*shape, args.rows, worker=worker):
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
    if args.two_workers:
        names = " | ".join(f"{name} µs" for name in TWO_WORKER_KERNELS)
        print(f"\n| layer | best one-thread-pool µs | {names} | best two-worker speed-up |")
        print("|---|---|" + "---|" * len(TWO_WORKER_KERNELS) + "---|")
        for (layer, rows), cell in by_cell.items():
            if rows != 1:
                continue
            single = min(cell[k]["us"] for k in ("packed", "transposed", "F.linear"))
            twos = [cell[name]["us"] for name in TWO_WORKER_KERNELS]
            print(f"| {layer} | {single:.0f} | " + " | ".join(f"{t:.0f}" for t in twos) + f" | {single / min(twos):.2f}× |")


if __name__ == "__main__":
    main()
