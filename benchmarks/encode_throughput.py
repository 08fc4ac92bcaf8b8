"""Encode throughput of a GRACE model against this machine's floor, one-pass vs two-pass.

The floor: a text costs about 2·P·(N + G) FLOPs (P parameters, N prompt tokens, G rationale
tokens). A batch computes its texts' common instruction prefix once (grace_st.runtime.generation's
shared prefix), so it does less work than that: ``floor%`` divides the floor's FLOPs by time and
peak, the project's floor; ``work%`` divides the FLOPs the batch actually computed (the prefix
counted once a batch), the machine's utilisation. The machine's peak is measured just before each cell with a large matrix multiply in the
model's dtype, on the best kernel the encoder may use. Every cell encodes the same texts; one-pass (``model.encode``) and the two-pass
reference (``generate``, then a second forward pass, then pooling) run back to back, so compare
them as ratios. Prints a table and writes JSON.

    python benchmarks/encode_throughput.py                      # the full matrix
    python benchmarks/encode_throughput.py --batch-sizes 16 --rationale-tokens 64 --build-times
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

import grace_st
from grace_st.runtime.cpu.packed_linear import matmul_peak_flops
from scoreboard import data_dir, sentences

try:
    from grace_st.runtime.second_pass import two_pass_reference
except ImportError:  # a grace-st from before the second pass had its own module
    from grace_st.runtime.generation import two_pass_reference

try:
    from grace_st.runtime.cpu.packed_linear import packed_dtypes, packing_enabled
except ImportError:  # a grace-st from before packed linear layers, benchmarked for comparison
    def packing_enabled() -> bool:
        return False

    def packed_dtypes() -> tuple:
        return ()

class PeakRSS:
    """Peak resident memory of this process while the block runs (sampled from /proc), above
    the level before it. Freed heap is handed back to the OS first, or memory an earlier cell
    freed would be reused unseen and every later cell would read near zero."""

    def __enter__(self):
        import ctypes
        import gc

        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.peak = self.baseline = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    def _sample(self):
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._rss())

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def prompt_tokens(encoder, texts: list[str]) -> list[list[int]]:
    return encoder.prompt_token_ids(texts)[0]


def time_one_pass(model, texts, batch_size):
    with PeakRSS() as memory:
        start = time.perf_counter()
        items = grace_st.explain(model, texts, batch_size=batch_size)
        elapsed = time.perf_counter() - start
    generated = sum(len(model[0].tokenizer(item["rationale"], add_special_tokens=False)["input_ids"]) for item in items)
    return elapsed, generated, memory.peak - memory.baseline


def time_two_pass(model, texts, batch_size):
    encoder = model[0]
    with PeakRSS() as memory:
        start = time.perf_counter()
        for first in range(0, len(texts), batch_size):
            chunk = texts[first : first + batch_size]
            rows = prompt_tokens(encoder, chunk)
            features = encoder.preprocess(chunk)
            two_pass_reference(
                encoder.engine.view,
                rows,
                features["instruction_lengths"].tolist(),
                max_new_tokens=encoder.max_rationale_tokens,
            )
        elapsed = time.perf_counter() - start
    return elapsed, memory.peak - memory.baseline


def build_times(model_path: str) -> dict:
    """First build (from the cached wheel, no download) and warm load of the default model."""

    home = Path(tempfile.mkdtemp(prefix="grace-bench-home-"))
    try:
        wheel = grace_st.default_model.grace_home() / "wheels" / grace_st.default_model.WHEEL_NAME
        if wheel.is_file():
            (home / "wheels").mkdir(parents=True)
            shutil.copy(wheel, home / "wheels" / wheel.name)
        start = time.perf_counter()
        grace_st.default_model_path(home)
        first_build = time.perf_counter() - start
    finally:
        shutil.rmtree(home, ignore_errors=True)
    start = time.perf_counter()
    grace_st.default_model_path()
    cached_lookup = time.perf_counter() - start
    start = time.perf_counter()
    grace_st.load(model_path, device="cpu")
    warm_load = time.perf_counter() - start
    return {"first_build_s": first_build, "cached_path_s": cached_lookup, "warm_load_s": warm_load}


def sts_spearman(model, pairs: int, batch_size: int) -> float:
    from scipy.stats import spearmanr

    dev = data_dir() / "stsb" / "dev.tsv"
    if not dev.is_file():
        raise SystemExit(f"--sts-pairs needs {dev}")
    rows = [line.split("\t") for line in dev.read_text(encoding="utf-8").splitlines()[1 : pairs + 1]]
    first = model.encode([r[1] for r in rows], batch_size=batch_size, normalize_embeddings=True)
    second = model.encode([r[2] for r in rows], batch_size=batch_size, normalize_embeddings=True)
    return float(spearmanr((first * second).sum(1), [float(r[0]) for r in rows]).statistic)


def run_dtype(model_path: str, dtype: torch.dtype, args) -> dict:
    """Every (batch size, G) cell for one weights dtype, against the matmul peak in that dtype."""

    model = grace_st.load(model_path, device="cpu", model_kwargs={"dtype": dtype})
    encoder = model[0]
    params = sum(p.numel() for p in encoder.model.parameters())
    run = {
        "dtype": str(dtype),
        "parameters": params,
        "embedding_dimension": encoder.get_embedding_dimension(),
        "packed_linears": packing_enabled() and dtype in packed_dtypes(),
        "rows": [],
    }
    print(f"\nmodel {model_path}: {params / 1e6:.1f}M params, {dtype}, {torch.get_num_threads()} threads, "
          f"embedding dim {run['embedding_dimension']}, oneDNN packed linears: {run['packed_linears']}\n"
          "peak: this machine's best matmul GFLOP/s measured just before each cell (machines are noisy); "
          "floor% = 2·P·(prompt + rationale tokens) / time / peak; work% = the same with the shared instruction "
          "prefix counted once a batch, or with the prefix cache on once a run (the FLOPs actually computed)")
    header = (f"{'batch':>5} {'G':>4} {'prefix':>6} {'texts':>5} {'texts/s':>8} {'tok/s':>8} {'peak':>6} {'floor%':>7} {'work%':>6} "
              f"{'2-pass t/s':>10} {'1p/2p':>6} {'MB':>6}")
    print(header)
    resident = PeakRSS._rss()
    for batch_size in args.batch_sizes:
        texts, source = sentences(args.texts or max(8, 2 * batch_size))
        run["texts_source"] = source
        prompt_lengths = [len(row) for row in prompt_tokens(encoder, texts)]
        batches = -(-len(texts) // batch_size)
        span = encoder.prompt_template(encoder.instructions["default"]).instruction_span
        for g, cached in [(g, c) for g in args.rationale_tokens for c in args.prefix_cache]:
            encoder.decode_options = dataclasses.replace(encoder.decode_options, prefix_cache=cached == "on")
            shared = span if batch_size > 1 or cached == "on" else 0
            encoder.max_rationale_tokens = g
            grace_st.explain(model, texts[: min(2, len(texts))], batch_size=batch_size)  # warm-up
            if "resident_after_first_encode_mb" not in run:  # the packed weight copy is made here, once
                run["resident_after_load_mb"] = resident / 2**20
                run["resident_after_first_encode_mb"] = PeakRSS._rss() / 2**20
            peak, kernel = matmul_peak_flops(dtype)
            # best of --repeats, one-pass and two-pass interleaved: the quietest moment of each, as for the peak
            timings = []
            for _ in range(args.repeats):
                timings.append(time_one_pass(model, texts, batch_size))
                if not args.no_two_pass:
                    timings.append(time_two_pass(model, texts, batch_size))
            one_pass = timings[:: 1 if args.no_two_pass else 2]
            elapsed, generated, memory = min(t[0] for t in one_pass), one_pass[0][1], max(t[2] for t in one_pass)
            tokens = sum(prompt_lengths) + generated
            # the prefix once a batch, or (cached) once before the timed calls
            computed = tokens - shared * (len(texts) - (0 if cached == "on" else batches))
            row = {
                "batch_size": batch_size,
                "rationale_tokens": g,
                "prefix_cache": cached,
                "texts": len(texts),
                "mean_prompt_tokens": sum(prompt_lengths) / len(texts),
                "mean_rationale_tokens": generated / len(texts),
                "one_pass_s": elapsed,
                "repeats": args.repeats,
                "texts_per_s": len(texts) / elapsed,
                "tokens_per_s": tokens / elapsed,
                "matmul_peak_gflops": peak / 1e9,
                "matmul_peak_kernel": kernel,
                "floor_fraction": 2 * params * tokens / elapsed / peak,
                "computed_tokens": computed,
                "work_fraction": 2 * params * computed / elapsed / peak,
                "one_pass_peak_rss_mb": memory / 2**20,
            }
            if not args.no_two_pass:
                two_elapsed, two_memory = min(t[0] for t in timings[1::2]), max(t[1] for t in timings[1::2])
                row.update(
                    two_pass_s=two_elapsed,
                    two_pass_texts_per_s=len(texts) / two_elapsed,
                    one_pass_speedup=two_elapsed / elapsed,
                    two_pass_peak_rss_mb=two_memory / 2**20,
                )
            run["rows"].append(row)
            two = (f"{row['two_pass_texts_per_s']:>10.2f} {row['one_pass_speedup']:>6.2f}"
                   if "two_pass_s" in row else f"{'-':>10} {'-':>6}")
            print(f"{batch_size:>5} {g:>4} {cached:>6} {len(texts):>5} {row['texts_per_s']:>8.2f} {row['tokens_per_s']:>8.1f} "
                  f"{peak / 1e9:>6.0f} {100 * row['floor_fraction']:>6.1f}% "
                  f"{100 * row['work_fraction']:>5.1f}% {two} {row['one_pass_peak_rss_mb']:>6.0f}", flush=True)
    print(f"resident memory: {run['resident_after_load_mb']:.0f} MB after loading, "
          f"{run['resident_after_first_encode_mb']:.0f} MB after the first encode")
    if args.sts_pairs:
        run["sts_spearman"] = {}
        for g in args.rationale_tokens:
            encoder.max_rationale_tokens = g
            run["sts_spearman"][g] = sts_spearman(model, args.sts_pairs, max(args.batch_sizes))
            print(f"STS-B dev Spearman, {args.sts_pairs} pairs, G={g}: {run['sts_spearman'][g]:.4f}", flush=True)
    return run


def cold_vs_warm(model_path: str, args) -> dict:
    """The same texts twice through a fresh rationale cache: generation, then hits only."""

    model = grace_st.load(model_path, device="cpu")
    encoder = model[0]
    encoder.max_rationale_tokens = args.rationale_tokens[-1]
    texts, source = sentences(args.cache_texts)
    batch_size = max(args.batch_sizes)
    with tempfile.TemporaryDirectory() as folder:
        encoder.set_rationale_cache(Path(folder) / "rationales.sqlite")
        start = time.perf_counter()
        cold = model.encode(texts, batch_size=batch_size)
        cold_s = time.perf_counter() - start
        start = time.perf_counter()
        warm = model.encode(texts, batch_size=batch_size)
        warm_s = time.perf_counter() - start
        size = (Path(folder) / "rationales.sqlite").stat().st_size
    result = {
        "texts": len(texts), "source": source, "rationale_tokens": encoder.max_rationale_tokens, "batch_size": batch_size,
        "cold_s": cold_s, "warm_s": warm_s, "speedup": cold_s / warm_s, "identical": bool((cold == warm).all()),
        "cache_file_mb": size / 2**20,
    }
    print(f"\nrationale cache, {len(texts)} texts, G={encoder.max_rationale_tokens}, batch {batch_size}: "
          f"cold {cold_s:.1f} s, warm {warm_s:.2f} s ({cold_s / warm_s:.0f}x), identical={result['identical']}, "
          f"file {result['cache_file_mb']:.1f} MB", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="GRACE model directory (default: the embedded default model)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rationale-tokens", type=int, nargs="+", default=[0, 32, 64, 128])
    parser.add_argument("--texts", type=int, help="texts per cell (default: 2 batches, at least 8)")
    parser.add_argument("--no-two-pass", action="store_true", help="skip the two-pass reference")
    parser.add_argument("--repeats", type=int, default=1, help="time each cell this many times, report the best")
    parser.add_argument("--build-times", action="store_true", help="also time a fresh default-model build")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--dtypes", nargs="+", default=["float32"], help="weights dtypes to compare, e.g. float32 bfloat16")
    parser.add_argument("--sts-pairs", type=int, default=0,
                        help="also score STS-B dev Spearman on this many pairs for each dtype and G (quality beside speed)")
    parser.add_argument("--cache-texts", type=int, default=0,
                        help="also time cold vs warm encode of this many texts through a fresh rationale cache")
    parser.add_argument("--prefix-cache", nargs="+", choices=["off", "on"], default=["off", "on"],
                        help="the instruction prefix cache (DecodeOptions.prefix_cache) off, on, or each")
    parser.add_argument("--out", default="benchmarks/results/encode_throughput.json")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    model_path = args.model or grace_st.default_model_path()
    report = {"model": model_path, "torch_threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(), "runs": []}
    if args.build_times:
        report["build"] = build_times(model_path)
    for dtype_name in args.dtypes:
        report["runs"].append(run_dtype(model_path, getattr(torch, dtype_name), args))
    if args.cache_texts:
        report["cache"] = cold_vs_warm(model_path, args)
    if "build" in report:
        build = report["build"]
        print(f"default model: first build {build['first_build_s']:.1f} s, cached path {build['cached_path_s'] * 1e3:.2f} ms, "
              f"warm load {build['warm_load_s']:.2f} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
