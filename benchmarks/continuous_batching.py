"""Continuous batching against batch-at-a-time decoding, and the native step against PyTorch's, side
by side in one run.

The same texts, the same model, its own budget, encoded up to three ways, interleaved ``--repeats`` times:

- ``pytorch-batches``: ``encode(texts, batch_size=B)`` with every row of a batch decoding at once
  (``DecodeOptions(decode_rows=None)``), PyTorch running the prompt pass and every step
  (``native_step=False``): the code before the native step;
- ``batches``: the same with the prompt pass and the steps as native calls (:mod:`grace_st.runtime.cpu.native_step`);
- ``stream``: ``encode(texts, batch_size=len(texts))`` with ``decode_rows=B``: B rows decode at once
  and a row whose rationale ended hands its slot to the next text.

``work%`` is as in ``encode_throughput.py``: 2 · parameters · tokens computed (prompts with their
shared instruction prefix counted once a prefill, plus rationale tokens) / time / the machine's
matmul peak, measured before each arm. ``live rows`` is the mean number of rows a decoding step fed.
Also compares every arm's rationales and embeddings with the first arm's. Prints a table, writes JSON.

    python benchmarks/continuous_batching.py                          # 1,000 STS-B dev sentences, the default
    python benchmarks/continuous_batching.py --texts 200 --repeats 1  # quicker
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import platform
import time
from pathlib import Path

import torch

import grace_st
from grace_st.runtime import decoding
from grace_st.runtime.cpu.packed_linear import matmul_peak_flops
from scoreboard import sentences

OUT = Path(__file__).parent / "results" / "continuous_batching.json"


class StepCounter:
    """Counts decoding steps, rows fed and prefills (IncrementalDecoder's calls) while on."""

    def __enter__(self):
        self.steps = self.rows = self.prefills = 0
        self._step, self._prefill = decoding.IncrementalDecoder.step, decoding.IncrementalDecoder._prefill
        counter = self

        def step(decoder, tokens, alive, *args, **kwargs):
            counter.steps += 1
            counter.rows += int(alive.sum())
            return counter._step(decoder, tokens, alive, *args, **kwargs)

        def prefill(decoder, *args, **kwargs):
            counter.prefills += 1
            return counter._prefill(decoder, *args, **kwargs)

        decoding.IncrementalDecoder.step, decoding.IncrementalDecoder._prefill = step, prefill
        return self

    def __exit__(self, *exc):
        decoding.IncrementalDecoder.step, decoding.IncrementalDecoder._prefill = self._step, self._prefill


def keep_freed_memory() -> None:
    """glibc's malloc serves blocks over its mmap threshold (at most 32 MB) with fresh pages each time and
    trims the heap's free top: every large tensor then page-faults its memory in again. Off: no mmap,
    no trimming."""
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
    if not (libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim_threshold, 2**40)):
        raise SystemExit("--keep-freed-memory: mallopt refused (not glibc?)")


# arm -> (stream the texts through the rows, decoding steps and prompt passes as native calls)
ARMS = {"pytorch-batches": (False, False), "batches": (False, True), "stream": (True, True)}


def run_arm(model, texts: list[str], rows: int, arm: str) -> dict:
    encoder = model[0]
    stream, native = ARMS[arm]
    encoder.decode_options = dataclasses.replace(
        encoder.decode_options, decode_rows=rows if stream else None, native_step=native
    )
    with StepCounter() as counter:
        start = time.perf_counter()
        out = model.encode(
            texts, batch_size=len(texts) if stream else rows, output_value=None, show_progress_bar=False
        )
        elapsed = time.perf_counter() - start
    embeddings = torch.stack([o["sentence_embedding"] for o in out]).float()
    rationales = [tuple(t for t in o["rationale_token_ids"][0].tolist() if t >= 0) for o in out]
    return {"seconds": elapsed, "steps": counter.steps, "fed_rows": counter.rows, "prefills": counter.prefills,
            "embeddings": embeddings, "rationales": rationales}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a saved model (default: the trained embedded default)")
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=64, help="rows decoded at once, both ways")
    parser.add_argument("--repeats", type=int, default=2, help="each arm this many times, interleaved; best kept")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--arms", nargs="+", choices=list(ARMS), default=list(ARMS),
        help="pytorch-batches: batches with PyTorch's own steps and prompt pass (grace_st.runtime.cpu.native_step off), as "
             "before the native step",
    )
    parser.add_argument(
        "--keep-freed-memory", action="store_true",
        help="glibc only: large blocks from the heap and never handed back (mallopt), to measure what the page "
             "faults of fresh allocations cost; a process-wide setting the library itself never makes",
    )
    args = parser.parse_args()
    if args.keep_freed_memory:
        keep_freed_memory()

    path = args.model or grace_st.default_model_path()
    model = grace_st.load(path, device="cpu")
    encoder = model[0]
    texts, source = sentences(args.texts)
    budget = encoder.rationale_budget("default")
    params = sum(p.numel() for p in encoder.model.parameters())
    prompts = encoder.prompt_token_ids(texts)[0]
    shared = encoder.prompt_template(encoder.instructions["default"]).instruction_span
    model.encode(texts[:4], batch_size=4)  # warm-up: the packed weight copies are made once
    print(f"model {path}: {params / 1e6:.1f}M params, {len(texts)} texts ({source}), G = {budget}, "
          f"{args.rows} rows at once, {torch.get_num_threads()} threads")

    arms: dict[str, list[dict]] = {name: [] for name in args.arms}
    for _ in range(args.repeats):
        for name, results in arms.items():
            peak, _kernel = matmul_peak_flops(torch.float32)
            results.append({**run_arm(model, texts, args.rows, name), "peak": peak})

    rows = []
    for name, results in arms.items():
        best = min(results, key=lambda r: r["seconds"])
        generated = sum(len(r) for r in best["rationales"])
        # every prefill computes the shared instruction prefix once; a row's other prompt tokens once each
        computed = sum(len(p) for p in prompts) - shared * (len(texts) - best["prefills"]) + generated
        rows.append({
            "arm": name,
            "seconds": best["seconds"],
            "all_seconds": [r["seconds"] for r in results],
            "texts_per_s": len(texts) / best["seconds"],
            "mean_rationale_tokens": generated / len(texts),
            "decode_steps": best["steps"],
            "mean_live_rows": best["fed_rows"] / max(best["steps"], 1),
            "prefills": best["prefills"],
            "matmul_peak_gflops": best["peak"] / 1e9,
            "work_fraction": 2 * params * computed / best["seconds"] / best["peak"],
        })
    # every arm against the first: the same rationales and embeddings, and its speed
    reference_name = args.arms[0]
    reference = arms[reference_name][0]
    for row in rows:
        result = arms[row["arm"]][0]
        row["same_rationale_fraction"] = sum(
            a == b for a, b in zip(reference["rationales"], result["rationales"])
        ) / len(texts)
        row["min_embedding_cosine"] = torch.nn.functional.cosine_similarity(
            reference["embeddings"], result["embeddings"]
        ).min().item()
        row["speedup"] = rows[0]["seconds"] / row["seconds"]

    print(f"{'arm':>15} {'s':>8} {'texts/s':>8} {'steps':>6} {'live rows':>9} {'prefills':>8} {'peak GF':>7} "
          f"{'work%':>6} {'speed':>6} {'same rationale':>14} {'min cosine':>10}")
    for row in rows:
        print(f"{row['arm']:>15} {row['seconds']:>8.1f} {row['texts_per_s']:>8.2f} {row['decode_steps']:>6} "
              f"{row['mean_live_rows']:>9.1f} {row['prefills']:>8} {row['matmul_peak_gflops']:>7.0f} "
              f"{100 * row['work_fraction']:>5.1f}% {row['speedup']:>5.2f}x {100 * row['same_rationale_fraction']:>13.1f}% "
              f"{row['min_embedding_cosine']:>10.6f}")
    print(f"speed, rationales and embeddings against {reference_name}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "model": str(path), "texts": len(texts), "texts_source": source, "rationale_budget": budget,
        "rows_at_once": args.rows, "threads": torch.get_num_threads(), "repeats": args.repeats,
        "machine": platform.processor() or platform.machine(), "reference_arm": reference_name, "arms": rows,
        "keep_freed_memory": args.keep_freed_memory,
    }, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
