"""GIRCSE's K curve: the dev scoreboard's short-text tasks (STS-B dev, SICK-R trial, Banking77, MRPC val) at
K = 1, 3, 5, 10 and 20 soft tokens, for one or more GIRCSE models (the shipped one, or models trained in either prompt
format: the chat template or the reference's ``Instruct: …\\nQuery:``). ``benchmarks/budget_curve.py`` measures the
models that think in text.

One soft-token pass of K_max steps gives every K at once: the embedding at K = k is z_k, the mean of the first k
generated states (gircse.md, Eq. 4), and the k-step process does not depend on how many steps follow, so z_k of a
K_max run is the K = k embedding (checked against ``encode`` at one K for a few texts). Each model is scored in the
format it was trained in. Appends to ``--out`` (one entry per label) and prints the table.

    python benchmarks/gircse_k_curve.py --model "GIRCSE default=gircse" --out benchmarks/results/gircse_k_curve.json
    python benchmarks/gircse_k_curve.py --model "instruct, seed 42=runs/gircse_instruct_s42/checkpoint-00000200" \\
        --out benchmarks/results/gircse_k_curve.json      # appends a row
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

import grace_st
from grace_st.runtime.batch import left_pad
from scoreboard import SIZES, evaluate, load_tasks

TASKS = ("STS-B dev", "SICK-R trial", "Banking77", "MRPC val")
STEPS = (1, 3, 5, 10, 20)


class EveryK:
    """z_1..z_Kmax of each text (L2-normed), computed once a text and prompt type."""

    def __init__(self, model, batch_size: int = 32):
        self.encoder, self.batch_size, self.cache = model[0], batch_size, {}

    @torch.no_grad()
    def embeddings(self, texts: list[str], kind: str) -> np.ndarray:
        missing = [t for t in dict.fromkeys(texts) if (kind, t) not in self.cache]
        engine = self.encoder.engine
        for start in range(0, len(missing), self.batch_size):
            chunk = missing[start : start + self.batch_size]
            rows, _ = self.encoder.prompt_token_ids(chunk, task=kind)
            ids, mask = left_pad(rows, self.encoder.pad_token_id)
            steps = torch.nn.functional.normalize(engine.step_embeddings(ids, mask, max(STEPS)).float(), dim=-1)
            for text, row in zip(chunk, steps.numpy()):
                self.cache[(kind, text)] = row
        return np.stack([self.cache[(kind, t)] for t in texts])

    def at(self, k: int):
        """A stand-in for the model whose encode calls return the K = k embeddings."""
        outer = self

        class AtK:
            def _encode(self, texts, kind):
                return outer.embeddings(list(texts), kind)[:, k - 1]

            def encode(self, texts, **_):
                return self._encode(texts, "default")

            def encode_query(self, texts, **_):
                return self._encode(texts, "query")

            def encode_document(self, texts, **_):
                return self._encode(texts, "document")

        return AtK()


def check_against_encode(model, every: EveryK, texts: list[str], k: int = 5) -> float:
    encoder = model[0]
    saved = encoder.max_rationale_tokens
    encoder.max_rationale_tokens = k
    direct = model.encode(texts, normalize_embeddings=True)
    encoder.max_rationale_tokens = saved
    return float(np.abs(direct - every.at(k).encode(texts)).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True, help="LABEL=PATH ('gircse': the shipped adapter)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    tasks = load_tasks(SIZES)
    report = json.loads(args.out.read_text()) if args.out.is_file() else {"tasks": list(TASKS), "models": {}}
    for spec in args.model:
        label, path = spec.split("=", 1)
        path = grace_st.default_model_path(method="gircse") if path == "gircse" else path
        model = grace_st.load(path, device="cpu")
        encoder = model[0]
        every = EveryK(model)
        started, cpu = time.perf_counter(), time.process_time()
        rows = {}
        for k in STEPS:
            scores, _ = evaluate(every.at(k), tasks, batch_size=32, only=TASKS)
            rows[str(k)] = {**scores, "mean": float(np.mean([scores[t] for t in TASKS]))}
        check = check_against_encode(model, every, tasks["STS-B dev"][0][:8])
        report["models"][label] = {
            "path": str(path),
            "prompt_format": encoder.prompt_format,
            "by_K": rows,
            "max_abs_difference_from_encode_at_K5": check,
            "seconds": time.perf_counter() - started,
            "cpu_seconds": time.process_time() - cpu,
        }
        args.out.write_text(json.dumps(report, indent=1))
    print("| model | format | " + " | ".join(f"K={k} mean" for k in STEPS) + " |")
    print("|---|---|" + "---|" * len(STEPS))
    for label, entry in report["models"].items():
        means = " | ".join(f"{entry['by_K'][str(k)]['mean']:.3f}" for k in STEPS)
        print(f"| {label} | {entry['prompt_format']} | {means} |")


if __name__ == "__main__":
    main()
