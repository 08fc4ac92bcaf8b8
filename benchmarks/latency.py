"""One query at a time, as a search box sends them: ``encode_query`` latency against this machine's floor.

Each cell encodes the same real queries one by one (the SciFact claims training holds back, then Banking77
texts the scoreboard keeps out of training), at one query rationale budget G, with the weights in one form:
float32 (as saved), bfloat16 (``model_kwargs={"dtype": torch.bfloat16}``) or int8 (``model_kwargs=
{"weight_quantization": "int8"}``, grace_st.runtime.cpu.quantization), and float32 as ``encode`` ran before the native
single-row step (``float32-pytorch-step``: PyTorch's step, grace_st.runtime.cpu.native_step off; the "vs before" column) or
before the one-row layout too (``float32-packed-only``, a choice, not run by default). p50/p95 are over the queries, after one warm-up call.

The floor of one query is a roofline over its passes: the prompt pass costs at least the larger of reading
every weight once and its FLOPs (2 · P · prompt tokens) at the matmul peak of the kernel it runs (bfloat16
only where the CPU has bfloat16 kernels, else float32); each decoding step at batch 1
costs at least one read of every weight (bytes as stored: 4, 2 or 1 a weight plus the int8 scales; the
embedding table counts only where it is also the LM head). Read bandwidth and matmul peak are measured by
the script itself, just before the cells, with the same thread count. ``floor%`` is the median over
queries of floor / time: 100 % would mean the weights stream at the measured bandwidth and nothing else costs.

Each cell runs with the instruction prefix cache off and on (``--prefix-cache off on``;
``DecodeOptions.prefix_cache``, grace_st.runtime.prefix_cache): on, a query's prompt pass computes only its
tokens after the instruction prefix, and its floor counts those tokens' FLOPs only. ``plain p50`` is a plain
PyTorch forward of the same whole prompt at batch 1 (``model(input_ids)``, autograd off), timed in the same cell.

Also per form: the first call a CLI user waits for (a fresh process: load, then one ``encode_query``), and,
against float32 at the same G, the share of queries whose rationale is token for token the same and the
mean cosine of their embeddings.

    python benchmarks/latency.py                  # float32 / bfloat16 / int8 / float32-pytorch-step × G 0, 16, 32, 64
    python benchmarks/latency.py --weights float32 int8 --budgets 32 --queries 40
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import grace_st
from grace_st.runtime.cpu.packed_linear import matmul_peak_flops, native_bfloat16
from grace_st.runtime.cpu.quantization import Int8WeightOnlyLinear
from scoreboard import banking77, data_dir, scifact, write_json

WEIGHTS = {
    "float32": {},
    "bfloat16": {"dtype": torch.bfloat16},
    "int8": {"weight_quantization": "int8"},
    # float32 as encode ran it before the native single-row step (grace_st.runtime.cpu.native_step): PyTorch's
    # step, with the one-row layout. The "vs before" column divides by this row's p50.
    "float32-pytorch-step": {},
    "int8-pytorch-step": {"weight_quantization": "int8"},
    # float32 as encode ran it before the one-row layout (grace_st.runtime.cpu.packed_linear): PyTorch's step, every
    # product on the packed weight (the "before" of the one-row layout).
    "float32-packed-only": {},
}
BEFORE = "float32-pytorch-step"
DEFAULT_WEIGHTS = ["float32", "bfloat16", "int8", BEFORE]


def queries(count: int) -> tuple[list[str], str]:
    """The held-back SciFact claims, then Banking77's held-out texts, ``count`` in all."""
    data = data_dir()
    if not data.is_dir():
        raise SystemExit(
            f"{data} is missing: this benchmark times real queries from the shared data folder ($GRACE_ST_DATA)"
        )
    claims, _, _ = scifact(data / "scifact", 0, 0)
    texts = list(claims.values())
    _, _, banking, _ = banking77(data / "banking77" / "train.csv", 500, max(0, count - len(texts)))
    texts = (texts + banking)[:count]
    return (
        texts,
        f"{min(len(claims), count)} held-back SciFact claims + {max(0, count - len(claims))} Banking77 held-out texts",
    )


def read_bandwidth(size_mb: int = 512, trials: int = 5) -> float:
    """Bytes/s of the best of several sums over a buffer far larger than the caches."""
    buffer = torch.ones(size_mb * 2**20 // 4)
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best


def weight_bytes_per_token(model) -> int:
    """Bytes a decoding step reads: every linear layer's weight as stored (the LM head too)."""
    total = 0
    for module in model.modules():
        if isinstance(module, Int8WeightOnlyLinear):
            total += module.qweight.numel() + module.scale.numel() * module.scale.element_size()
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


def load(path: str, weights: str):
    import grace_st

    # grace_st.load: the --model given runs no code that ships with it
    model = grace_st.load(path, device="cpu", model_kwargs=WEIGHTS[weights])
    if weights.endswith("-pytorch-step") or weights == "float32-packed-only":
        model[0].decode_options = dataclasses.replace(model[0].decode_options, native_step=False)
    if weights == "float32-packed-only":
        model[0].decode_options = dataclasses.replace(model[0].decode_options, one_row_layout=False)
    return model


def first_call(path: str, weights: str, threads: int) -> dict:
    """Load + first ``encode_query`` in a fresh process (what ``grace-st encode`` waits for)."""
    code = (
        "import json, sys, time; start = time.perf_counter()\n"
        "import torch; torch.set_num_threads(int(sys.argv[3]))\n"
        "sys.path.insert(0, sys.argv[4]); from latency import load\n"
        "model = load(sys.argv[1], sys.argv[2]); loaded = time.perf_counter()\n"
        "model.encode_query('Does vitamin D lower the risk of multiple sclerosis?')\n"
        "print(json.dumps({'load_s': loaded - start, 'first_encode_s': time.perf_counter() - loaded}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, path, weights, str(threads), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def plain_forward_seconds(model, texts: list[str]) -> list[float]:
    """A plain PyTorch forward of each query's whole prompt at batch 1 (no cache, no native step)."""
    rows, _ = model[0].prompt_token_ids(texts, task="query")
    lm, seconds = model[0].model, []
    with torch.no_grad():
        lm(input_ids=torch.tensor([rows[0]]))  # warm-up
        for row in rows:
            start = time.perf_counter()
            lm(input_ids=torch.tensor([row]))
            seconds.append(time.perf_counter() - start)
    return seconds


def time_queries(model, texts: list[str], budget: int) -> dict:
    encoder = model[0]
    budgets = encoder.max_rationale_tokens
    encoder.max_rationale_tokens = {**(budgets if isinstance(budgets, dict) else {"default": budgets}), "query": budget}
    model.encode_query(texts[0])  # warm-up: packing, allocator
    _, span = encoder.prompt_token_ids(texts[:1], task="query")
    seconds, steps, prompts, rationales, embeddings = [], [], [], [], []
    for text in texts:
        start = time.perf_counter()
        out = model.encode_query([text], output_value=None)[0]
        seconds.append(time.perf_counter() - start)
        ids = out["rationale_token_ids"][0].tolist()
        length = _rationale_length(ids, encoder) if budget else 0
        rationales.append(ids[:length])
        steps.append(length)
        prompts.append(int(out["input_ids"].shape[-1]))
        embeddings.append(out["sentence_embedding"].float().numpy())
    cached = [min(span, prompt - 1) if encoder.decode_options.prefix_cache else 0 for prompt in prompts]
    return {
        "seconds": seconds, "steps": steps, "prompts": prompts, "cached": cached, "rationales": rationales,
        "embeddings": embeddings,
    }


def _rationale_length(ids: list[int], encoder) -> int:
    """Tokens the rationale fed (its end token included, padding after it not)."""
    stops = set(encoder.eos_token_ids)
    for position, token in enumerate(ids):
        if token in stops:
            return position + 1
    return len(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="GRACE model directory (default: the embedded trained default)")
    parser.add_argument("--weights", nargs="+", default=DEFAULT_WEIGHTS, choices=list(WEIGHTS))
    parser.add_argument("--budgets", nargs="+", type=int, default=[0, 16, 32, 64])
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--prefix-cache", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument("--out", default="benchmarks/results/latency.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or str(grace_st.default_model_path())
    texts, source = queries(args.queries)
    bandwidth = read_bandwidth()
    # bfloat16's peak only where the CPU has bfloat16 kernels: elsewhere no path runs at it (floors below), and
    # measuring an emulated 2048^3 bfloat16 matmul takes minutes
    dtypes = {"float32": torch.float32, **({"bfloat16": torch.bfloat16} if native_bfloat16() else {})}
    peaks = {name: matmul_peak_flops(dtype)[0] for name, dtype in dtypes.items()}
    report = {
        "model": path,
        "queries": source,
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "read_bandwidth_GBps": bandwidth / 1e9,
        "matmul_peak_GFLOPs": {k: v / 1e9 for k, v in peaks.items()},
        "rows": [],
    }
    print(
        f"{source}; {args.threads} threads; read bandwidth {bandwidth / 1e9:.1f} GB/s; "
        "peak " + ", ".join(f"{peak / 1e9:.0f} GFLOP/s {name}" for name, peak in peaks.items())
    )
    reference: dict[int, dict] = {}
    for weights in args.weights:
        started = first_call(path, weights, args.threads)
        model = load(path, weights)
        lm = model[0].model
        per_token = weight_bytes_per_token(lm)
        parameters = sum(p.numel() for p in lm.parameters()) + sum(
            m.qweight.numel() for m in lm.modules() if isinstance(m, Int8WeightOnlyLinear)
        )
        # The prompt pass's FLOPs at the peak of the kernel it runs: bfloat16 matmuls only where the CPU has
        # bfloat16 kernels; elsewhere bfloat16 weights are emulated and int8's many-row calls run in float32.
        peak = peaks.get("bfloat16", peaks["float32"]) if weights.startswith(("bfloat16", "int8")) else peaks["float32"]
        for budget, cached in [(b, c) for b in args.budgets for c in args.prefix_cache]:
            model[0].decode_options = dataclasses.replace(model[0].decode_options, prefix_cache=cached == "on")
            cell = time_queries(model, texts, budget)
            plain = np.median(plain_forward_seconds(model, texts)) if budget == 0 else None
            seconds = np.array(cell["seconds"])
            floors = np.array(
                [
                    max(per_token / bandwidth, 2 * parameters * (prompt - prefix) / peak)
                    + steps * per_token / bandwidth
                    for prompt, prefix, steps in zip(cell["prompts"], cell["cached"], cell["steps"])
                ]
            )
            row = {
                "weights": weights,
                "prefix_cache": cached,
                "budget": budget,
                "plain_forward_p50_s": None if plain is None else float(plain),
                "queries": len(texts),
                "p50_s": float(np.median(seconds)),
                "p95_s": float(np.percentile(seconds, 95)),
                "mean_prompt_tokens": float(np.mean(cell["prompts"])),
                "mean_rationale_tokens": float(np.mean(cell["steps"])),
                "weight_MB_per_token": per_token / 1e6,
                "floor_p50_s": float(np.median(floors)),
                "floor_fraction_p50": float(np.median(floors / seconds)),
                **started,
            }
            if weights == "float32" and cached == args.prefix_cache[0]:
                reference[budget] = cell
            elif budget in reference:
                same = [a == b for a, b in zip(cell["rationales"], reference[budget]["rationales"])]
                cosines = [
                    float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
                    for a, b in zip(cell["embeddings"], reference[budget]["embeddings"])
                ]
                row["same_rationale_as_float32"] = float(np.mean(same))
                row["mean_cosine_to_float32"] = float(np.mean(cosines))
            report["rows"].append(row)
            write_json(report, args.out)
            print(json.dumps(row))
        del model
    baseline = {(r["budget"], r["prefix_cache"]): r["p50_s"] for r in report["rows"] if r["weights"] == "float32"}
    before = {(r["budget"], r["prefix_cache"]): r["p50_s"] for r in report["rows"] if r["weights"] == BEFORE}
    print(
        "\n| weights | prefix cache | G | rationale tok | p50 s | p95 s | floor p50 s | % of floor | plain p50 s "
        "| vs float32 p50 | vs before p50 | same rationale | cosine | load + first call s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in report["rows"]:
        cell = (r["budget"], r["prefix_cache"])
        speedup = f"{baseline[cell] / r['p50_s']:.2f}×" if cell in baseline else "n/a"
        versus_before = f"{before[cell] / r['p50_s']:.2f}×" if cell in before else "n/a"
        same = f"{r['same_rationale_as_float32']:.0%}" if "same_rationale_as_float32" in r else "—"
        cosine = f"{r['mean_cosine_to_float32']:.4f}" if "mean_cosine_to_float32" in r else "—"
        print(
            f"| {r['weights']} | {r['prefix_cache']} | {r['budget']} | {r['mean_rationale_tokens']:.1f} | "
            f"{r['p50_s']:.3f} | "
            f"{r['p95_s']:.3f} | {r['floor_p50_s']:.3f} | {r['floor_fraction_p50']:.0%} | "
            + (f"{r['plain_forward_p50_s']:.3f} | " if r["plain_forward_p50_s"] is not None else "– | ")
            + f"{speedup} | {versus_before} | {same} | {cosine} | "
            f"{r['load_s']:.1f} + {r['first_encode_s']:.2f} |"
        )


if __name__ == "__main__":
    main()
