"""How close low-rank adapters (``grace_training.lowrank_adapter``) embed to the full-weight model they approximate.

For each candidate: the cosine between its embedding and the tuned model's, text by text, on STS-B dev sentences
(the ``default`` prompt type at the saved budget: a rationale is written, so a candidate whose greedy rationale
departs from the tuned model's shows it here) and SciFact corpus documents (``document``: the saved budget, 0 for
the scale recipe, so this is the prompt's states alone). A cheap screen before the scoreboard (dev_eval.py), which
is what decides; dev data only.

    python lab/scripts/lowrank_fidelity.py runs/yl_grace/checkpoint-00000100 runs/lr32_plain runs/lr32_white \
        --out lab/results/lowrank_fidelity.json
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import grace_st


def dev_texts(data: Path, count: int) -> dict[str, list[str]]:
    with open(data / "stsb" / "dev.tsv", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    with open(data / "scifact" / "corpus.jsonl", encoding="utf-8") as handle:
        documents = [json.loads(line) for _, line in zip(range(count), handle)]
    return {
        "default": [row["sentence1"] for row in rows[:count]],
        "document": [f"{d['title']} {d['text']}".strip() for d in documents],
    }


def embeddings(path: str, texts: dict[str, list[str]], repetition_penalty: float) -> dict[str, torch.Tensor]:
    model = grace_st.load(path, device="cpu")
    model[0].max_input_tokens = 512  # what dev_eval.py encodes with
    model[0].repetition_penalty = repetition_penalty
    encode = {"default": model.encode, "document": model.encode_document}
    return {kind: encode[kind](items, batch_size=32, convert_to_tensor=True) for kind, items in texts.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tuned", help="the full-weight model (or adapter on one) the candidates approximate")
    parser.add_argument("candidates", nargs="+")
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[3] / "shared" / "data")
    parser.add_argument("--texts", type=int, default=200, help="texts of each kind")
    parser.add_argument("--repetition-penalty", type=float, default=1.3, help="as the default decodes")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    texts = dev_texts(args.data, args.texts)
    start = time.perf_counter()
    reference = embeddings(args.tuned, texts, args.repetition_penalty)
    rows = []
    for path in args.candidates:
        found = embeddings(path, texts, args.repetition_penalty)
        row = {"model": path}
        for kind, tensor in found.items():
            cosine = torch.nn.functional.cosine_similarity(tensor, reference[kind], dim=-1)
            row[kind] = {
                "mean": float(cosine.mean()),
                "min": float(cosine.min()),
                "below_0.99": int((cosine < 0.99).sum()),
            }
        rows.append(row)
    print(f"cosine to {args.tuned} ({args.texts} texts each; {time.perf_counter() - start:.0f} s)")
    print(
        f"{'candidate':40s} {'STS-B mean':>10s} {'min':>6s} {'<0.99':>6s} {'SciFact doc mean':>16s} {'min':>6s} {'<0.99':>6s}"
    )
    for row in rows:
        d, s = row["default"], row["document"]
        print(
            f"{row['model'][-40:]:40s} {d['mean']:10.4f} {d['min']:6.3f} {d['below_0.99']:6d} "
            f"{s['mean']:16.4f} {s['min']:6.3f} {s['below_0.99']:6d}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"tuned": args.tuned, "texts": args.texts, "rows": rows}, indent=2) + "\n", encoding="utf-8"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
