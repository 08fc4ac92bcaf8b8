"""What each CPU decoding change buys, side by side in one run: the one-pass rollout of one batch
with transformers' ``DynamicCache`` or the preallocated KV cache, and with PyTorch's default
(MKL) linear layers or oneDNN-packed ones (grace_st.packed_linear). Variants run interleaved,
``--repeats`` rounds, and the best time of each is reported (this machine is shared and noisy).
Every variant must produce the same rationales; hidden states may differ by float32 rounding.

    python benchmarks/decode_ablation.py                  # batch 64, G = 64
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from encode_throughput import load_texts, matmul_peak_flops

import grace_st
from grace_st import generation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="GRACE model directory (default: the embedded default model)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rationale-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/decode_ablation.json")
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer
    from transformers import DynamicCache

    model_path = args.model or grace_st.default_model_path()
    encoder = SentenceTransformer(model_path, device="cpu", trust_remote_code=True)[0]
    texts, source = load_texts(args.batch_size)
    features = encoder.preprocess(texts)
    params = sum(p.numel() for p in encoder.model.parameters())
    preallocated = generation.preallocated_cache
    caches = {"dynamic": lambda model, capacity: DynamicCache(config=model.config), "preallocated": preallocated}
    variants = [(cache, kernel) for cache in caches for kernel in ("mkl", "onednn")]

    def rollout(cache: str, kernel: str):
        generation.preallocated_cache = caches[cache]
        os.environ["GRACE_ST_PACKED_LINEARS"] = "1" if kernel == "onednn" else "0"
        try:
            start = time.perf_counter()
            result = encoder.rollout(features)
            return time.perf_counter() - start, result
        finally:
            generation.preallocated_cache = preallocated
            os.environ.pop("GRACE_ST_PACKED_LINEARS")

    encoder.max_rationale_tokens = args.rationale_tokens
    rollout("preallocated", "onednn")  # warm-up, and the one-time weight packing
    best: dict = {}
    reference = None
    for _ in range(args.repeats):
        for variant in variants:
            elapsed, result = rollout(*variant)
            best[variant] = min(best.get(variant, float("inf")), elapsed)
            if reference is None:
                reference = result
            elif not torch.equal(result.rationale_ids, reference.rationale_ids):
                raise SystemExit(f"{variant} generated different rationales")
    peak, kernel = matmul_peak_flops(torch.float32)
    prompt_tokens = int(features["attention_mask"].sum())
    rationale_tokens = int((reference.rationale_ids >= 0).sum())
    flops = 2 * params * (prompt_tokens + rationale_tokens)
    baseline = best[("dynamic", "mkl")]
    print(f"batch {args.batch_size}, G = {args.rationale_tokens}, {source}: {prompt_tokens} prompt + {rationale_tokens} "
          f"rationale tokens; matmul peak {peak / 1e9:.0f} GFLOP/s ({kernel}); best of {args.repeats}")
    print(f"{'KV cache':>13} {'linears':>8} {'seconds':>8} {'texts/s':>8} {'floor%':>7} {'speed-up':>8}")
    rows = []
    for cache, kernel_name in variants:
        seconds = best[(cache, kernel_name)]
        row = {"kv_cache": cache, "linears": kernel_name, "seconds": seconds, "texts_per_s": args.batch_size / seconds,
               "floor_fraction": flops / seconds / peak, "speedup": baseline / seconds}
        rows.append(row)
        print(f"{cache:>13} {kernel_name:>8} {seconds:>8.2f} {row['texts_per_s']:>8.2f} "
              f"{100 * row['floor_fraction']:>6.1f}% {row['speedup']:>7.2f}x")
    report = {"model": model_path, "batch_size": args.batch_size, "rationale_tokens": args.rationale_tokens,
              "texts_source": source, "prompt_tokens": prompt_tokens, "generated_tokens": rationale_tokens,
              "matmul_peak_gflops": peak / 1e9, "matmul_peak_kernel": kernel, "repeats": args.repeats,
              "torch_threads": torch.get_num_threads(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
