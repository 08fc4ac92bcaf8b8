"""What the GRC model's pass costs fed two ways, side by side on the same rows: the masked pass training runs
(transformers' forward over ``P(x) ⊕ "None"`` and the latents, left-padded, on the packed kernels) and the prompt
pass ``encode`` runs (:func:`grace_st.methods.grc.latent_pass` with the engine's ``DecodeOptions``: the shared instruction
prefix once a batch, padding skipped, the native kernels). STS-B dev sentences (the default prompt type), held-back
SciFact claims (queries), SciFact abstracts (documents); each cell alternates the two and keeps the best of
``--repeats``, and reports how far apart their embeddings are. Prints a table and writes JSON.

    python benchmarks/grc_pass_cost.py --out benchmarks/results/grc_pass_cost.json
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from default_cost import cost_arguments, texts_by_prompt_type

import grace_st
import scoreboard
from grace_st.methods.grc import latent_pass
from grace_st.runtime.decoding import packed_linears_for


def timed(run) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    with torch.no_grad():
        embeddings = run()
    return time.perf_counter() - start, embeddings


def main() -> None:
    args = cost_arguments(__doc__)
    texts = texts_by_prompt_type(args.texts)
    encoder = grace_st.load(grace_st.default_model_path(method="grc"))[0]
    engine = encoder.engine

    def masked(rows):
        with packed_linears_for(encoder.model, engine.options):
            return latent_pass(engine.view, encoder.latent_tokens, rows).embeddings

    def prompt_pass(rows):
        return latent_pass(engine.view, encoder.latent_tokens, rows, prompt_pass=True).embeddings

    passes = {"masked pass": masked, "prompt pass": prompt_pass}
    for run in passes.values():  # packing the weights and binding the native kernels happen once, untimed
        timed(lambda run=run: run(encoder.prompt_token_ids(["warm-up"], task="default")[0]))
    report = {"threads": torch.get_num_threads(), "texts": args.texts, "batch_size": args.batch_size, "cells": {}}
    print("| prompt type | tokens a row | masked pass, s a text | prompt pass, s a text | speed-up | least cosine |")
    print("|---|---|---|---|---|---|")
    for kind, batch in texts.items():
        prompts, _ = encoder.prompt_token_ids(batch, task=kind)
        rows = [prompt + engine.document_response for prompt in prompts]
        batches = [rows[start : start + args.batch_size] for start in range(0, len(rows), args.batch_size)]
        best, embeddings = {name: float("inf") for name in passes}, {}
        for _ in range(args.repeats):
            for name, run in passes.items():
                seconds, embeddings[name] = timed(
                    lambda run=run, batches=batches: torch.cat([run(part) for part in batches])
                )
                best[name] = min(best[name], seconds)
        cosine = F.cosine_similarity(embeddings["masked pass"], embeddings["prompt pass"]).min().item()
        cell = {
            "tokens_a_row": sum(map(len, rows)) / len(rows) + encoder.latent_tokens.num_latent_tokens,
            **{name: {"s_per_text": seconds / len(rows)} for name, seconds in best.items()},
            "speed_up": best["masked pass"] / best["prompt pass"],
            "least_cosine": cosine,
        }
        report["cells"][kind] = cell
        scoreboard.write_json(report, args.out)
        print(
            f"| {kind} | {cell['tokens_a_row']:.0f} | {cell['masked pass']['s_per_text']:.3f} | "
            f"{cell['prompt pass']['s_per_text']:.3f} | {cell['speed_up']:.2f}× | {cosine:.7f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
