"""Whose answer a GRC model's latents read: the four short dev tasks (STS-B dev, SICK-R trial, Banking77, MRPC val;
every text the default prompt type) scored three ways on the same model:

- ``none``:  every text answers "None" (budget 0), the latents read the text alone;
- ``own``:   the model writes its own greedy answer at ``--budget``, then reads its latents (what ``encode`` does);
- ``start``: the start model writes the greedy answer, the trained model reads its latents after it: what a model
             trained with ``grc_response_targets: start`` saw in training (``grace_training.grc.response_targets``).

If the trained latents suffer from reading an answer unlike the one they were trained after, ``start`` scores above
``own``.

    python lab/scripts/grc_response_source.py runs/grc_m16_full_think_s42/checkpoint-00000050 \
        --out lab/results/grc_response_source_full_think_step50.json
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import grace_st
from grace_st import scoreboard
from grace_st.batch import Rationales, RolloutRequest, Thoughts
from grace_training.grc import response_targets

SHORT_TASKS = ("STS-B dev", "SICK-R trial", "Banking77", "MRPC val")


class ReadsAnswers:
    """``encode`` of a trained GRC model whose responses come from ``writer`` (None: "None" for every text, or the
    model's own when ``own``): the same pass ``encode`` runs, only y differs."""

    def __init__(self, trained, writer, budget: int, own: bool = False):
        self.encoder, self.writer = trained[0], writer
        self.budget = budget if (own or writer is not None) else 0

    @torch.no_grad()
    def encode(self, texts, batch_size=32, normalize_embeddings=True, show_progress_bar=False):
        engine, out = self.encoder.engine, []
        for start in range(0, len(texts), batch_size):
            rows, span = self.encoder.prompt_token_ids(texts[start : start + batch_size])
            request = RolloutRequest(rows, [span] * len(rows), 0.0, 1.0, self.budget)
            if self.writer is None:
                thoughts = engine.generate(request)
            else:
                answers = response_targets(self.encoder, rows, span, self.budget, "start", self.writer)
                thoughts = Thoughts(Rationales(answers, [-1] * len(rows), [False] * len(rows)))
            out.append(torch.nn.functional.normalize(engine.embed(request, thoughts), dim=-1).numpy())
        return np.concatenate(out)

    encode_query = encode_document = encode  # the short tasks encode every text as the default type


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a GRC model directory (a training checkpoint)")
    parser.add_argument("--start", default=None, help="the start model (default: the untrained embedded base)")
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    sizes = scoreboard.SIZES
    tasks = scoreboard.load_tasks(sizes)
    trained = grace_st.load(args.model)
    start = grace_st.load(args.start or grace_st.default_model_path(trained=False))[0].model.eval()
    ways = {
        "none": ReadsAnswers(trained, None, args.budget),
        "own": ReadsAnswers(trained, None, args.budget, own=True),
        "start": ReadsAnswers(trained, start, args.budget),
    }
    report = {"model": args.model, "start": args.start or "untrained embedded base", "budget": args.budget,
              "sizes": sizes, "scores": {}, "seconds": {}}
    for name, way in ways.items():
        began = time.perf_counter()
        scores, _ = scoreboard.evaluate(way, tasks, args.batch_size, only=SHORT_TASKS)
        report["scores"][name] = {**scores, "mean": float(np.mean(list(scores.values())))}
        report["seconds"][name] = time.perf_counter() - began
        scoreboard.write_json(report, args.out)
    print(f"| y | {' | '.join(SHORT_TASKS)} | mean |\n|---|{'---|' * (len(SHORT_TASKS) + 1)}")
    for name, scores in report["scores"].items():
        print(f"| {name} | " + " | ".join(f"{scores[t]:.4f}" for t in (*SHORT_TASKS, "mean")) + " |")


if __name__ == "__main__":
    main()
