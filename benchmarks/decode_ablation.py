"""What each CPU decoding change buys, side by side in one run: the one-pass rollout of one batch
with transformers' ``DynamicCache`` or the preallocated KV cache, with PyTorch's default (MKL)
linear layers or oneDNN-packed ones (grace_st.runtime.cpu.packed_linear), and with the prompts' common
instruction prefix fed once a row, once a batch, or once a run and kept (``cached``: the prefix cache, computed
by the warm-up call): the switches of grace_st.runtime.decoding.DecodeOptions
(finished rows leave the batch in every variant).
Variants run interleaved, ``--repeats`` rounds, and the best time of each is reported (this
machine is shared and noisy). Every variant must produce the same rationales; pooled embeddings
may differ by float32 rounding (the largest difference is printed).

    python benchmarks/decode_ablation.py                  # batch 64, G = 64
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import grace_st
from grace_st.runtime.batch import masked_mean
from grace_st.runtime.cpu.packed_linear import matmul_peak_flops
from grace_st.runtime.decoding import DecodeOptions
from scoreboard import sentences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="GRACE model directory (default: the embedded default model)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rationale-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/decode_ablation.json")
    args = parser.parse_args()


    model_path = args.model or grace_st.default_model_path()
    encoder = grace_st.load(model_path, device="cpu")[0]
    texts, source = sentences(args.batch_size)
    params = sum(p.numel() for p in encoder.model.parameters())
    # (KV cache, linear layers, instruction prefix): the first is the baseline, none of the changes
    variants = [(cache, kernel, "per row") for cache in ("dynamic", "preallocated") for kernel in ("mkl", "onednn")]
    variants.append(("preallocated", "onednn", "shared"))
    variants.append(("preallocated", "onednn", "cached"))  # DecodeOptions.prefix_cache: kept across calls

    def rollout(cache: str, kernel: str, prefix: str):
        encoder.decode_options = DecodeOptions(
            preallocated_cache=cache == "preallocated", share_prefix=prefix in ("shared", "cached"),
            prefix_cache=prefix == "cached", packed_linears=kernel == "onednn",
        )
        engine = encoder.engine
        start = time.perf_counter()
        result = engine.generate(request).single_pass()
        return time.perf_counter() - start, result

    encoder.max_rationale_tokens = args.rationale_tokens
    request = encoder.rollout_request(encoder.preprocess(texts))  # after the budget: preprocess reads it
    rollout("preallocated", "onednn", "shared")  # warm-up, and the one-time weight packing
    best: dict = {}
    difference: dict = {}
    reference = None
    for _ in range(args.repeats):
        for variant in variants:
            elapsed, result = rollout(*variant)
            best[variant] = min(best.get(variant, float("inf")), elapsed)
            pooled = masked_mean(result.token_embeddings, result.pooling_mask)
            if reference is None:
                reference = result
                reference_pooled = pooled
            elif not torch.equal(result.rationale_ids, reference.rationale_ids):
                raise SystemExit(f"{variant} generated different rationales")
            difference[variant] = float((pooled - reference_pooled).abs().max())
    peak, kernel = matmul_peak_flops(torch.float32)
    prompt_tokens = sum(len(row) for row in request.prompt_ids)
    rationale_tokens = int((reference.rationale_ids >= 0).sum())
    flops = 2 * params * (prompt_tokens + rationale_tokens)
    baseline = best[variants[0]]
    print(f"batch {args.batch_size}, G = {args.rationale_tokens}, {source}: {prompt_tokens} prompt + {rationale_tokens} "
          f"rationale tokens; matmul peak {peak / 1e9:.0f} GFLOP/s ({kernel}); best of {args.repeats}")
    print(f"{'KV cache':>13} {'linears':>8} {'prefix':>8} {'seconds':>8} {'texts/s':>8} {'floor%':>7} {'speed-up':>8} "
          f"{'max |Δ| pooled':>14}")
    rows = []
    for variant in variants:
        cache, kernel_name, prefix = variant
        seconds = best[variant]
        row = {"kv_cache": cache, "linears": kernel_name, "instruction_prefix": prefix, "seconds": seconds,
               "texts_per_s": args.batch_size / seconds, "floor_fraction": flops / seconds / peak,
               "speedup": baseline / seconds, "max_abs_pooled_difference": difference[variant]}
        rows.append(row)
        print(f"{cache:>13} {kernel_name:>8} {prefix:>8} {seconds:>8.2f} {row['texts_per_s']:>8.2f} "
              f"{100 * row['floor_fraction']:>6.1f}% {row['speedup']:>7.2f}x {row['max_abs_pooled_difference']:>14.1e}")
    report = {"model": model_path, "batch_size": args.batch_size, "rationale_tokens": args.rationale_tokens,
              "texts_source": source, "prompt_tokens": prompt_tokens, "generated_tokens": rationale_tokens,
              "matmul_peak_gflops": peak / 1e9, "matmul_peak_kernel": kernel, "repeats": args.repeats,
              "torch_threads": torch.get_num_threads(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
