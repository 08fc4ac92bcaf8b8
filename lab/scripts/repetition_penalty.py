"""The repetition penalty a decoding step applies, over the whole vocabulary against over the written tokens only.

``grace_st.generation.penalise_repeats`` used to compute CTRL's penalty for every (row, token) and keep it where
the row had written the token: two ``torch.where`` passes over rows × 49,152 logits a step. It now gathers the
written entries, penalises those and puts them back. Both arms side by side at the row counts a step feeds (1: a
query alone; 64: ``decode_rows``; 256), on logits of SmolLM2's vocabulary with each row having written ``--written``
tokens; checks the two give the same logits bit for bit. Prints a table, writes JSON.

    python lab/scripts/repetition_penalty.py                 # JSON: lab/results/repetition_penalty.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from grace_st.generation import penalise_repeats

OUT = Path(__file__).resolve().parents[1] / "results" / "repetition_penalty.json"  # lab/results
VOCAB = 49152  # SmolLM2's


def whole_vocabulary(logits: torch.Tensor, written: torch.Tensor, penalty: float) -> torch.Tensor:
    """The former formula: every entry penalised, the written ones kept."""
    return torch.where(written, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def best_ms(fn, seconds: float) -> float:
    """The fastest of repeated calls over ``seconds`` (noisy machines: the quietest moment)."""
    fn()
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--written", type=int, default=32, help="tokens each row has written (the shipped budget)")
    parser.add_argument("--penalty", type=float, default=1.3)
    parser.add_argument("--seconds", type=float, default=1.0, help="timing per cell")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(0)
    results = []
    print(f"{'rows':>5} {'whole vocab ms':>15} {'written only ms':>16} {'speed-up':>9} {'same':>5}")
    for rows in args.rows:
        logits = torch.randn(rows, VOCAB, generator=generator)
        written = torch.zeros(rows, VOCAB, dtype=torch.bool)
        written[torch.arange(rows)[:, None], torch.randint(0, VOCAB, (rows, args.written), generator=generator)] = True
        same = torch.equal(
            whole_vocabulary(logits, written, args.penalty), penalise_repeats(logits, written, args.penalty)
        )
        before = best_ms(lambda l=logits, w=written: whole_vocabulary(l, w, args.penalty), args.seconds)
        after = best_ms(lambda l=logits, w=written: penalise_repeats(l, w, args.penalty), args.seconds)
        results.append(
            {
                "rows": rows,
                "whole_vocabulary_ms": before,
                "written_only_ms": after,
                "speedup": before / after,
                "bit_identical": same,
            }
        )
        print(f"{rows:>5} {before:>15.3f} {after:>16.3f} {before / after:>8.1f}x {same!s:>5}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "threads": torch.get_num_threads(),
                "machine": platform.processor() or platform.machine(),
                "vocabulary": VOCAB,
                "written_per_row": args.written,
                "penalty": args.penalty,
                "cells": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
