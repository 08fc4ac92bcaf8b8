"""How close the calibrated low-rank adapter (``grace_training.lowrank_adapter``) embeds to the full-weight model it
approximates, against the rank: uniform ranks, and one rank budget spread over the layers by the share of each layer's
output energy a rank keeps per parameter it costs. Cosine to the tuned model's embedding, text by text, at G = 0 on 200
SciFact corpus documents and 200 STS-B dev sentences (dev data; the calibration is the tool's: 256 training instances).

    python lab/scripts/lowrank_rank_curve.py runs/yl_grace/checkpoint-00000100 --out lab/results/lowrank_rank_curve.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parent))  # lowrank_fidelity.py, beside this script

from lowrank_fidelity import dev_texts

import grace_st
from grace_training.lowrank_adapter import TARGET_MODULES, calibration_grams, delta_spectrum


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tuned")
    parser.add_argument("--config", type=Path, default=Path("grace_training/configs/scale_grace.yaml"))
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[3] / "shared" / "data")
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 48, 64])
    parser.add_argument(
        "--budget-rank", type=int, default=32, help="the allocated row spends this uniform rank's bytes"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    texts = dev_texts(args.data, 200)
    tuned = grace_st.load(args.tuned, device="cpu")
    model = grace_st.load(grace_st.default_model_path(trained=False), device="cpu")
    for m in (tuned, model):
        m[0].max_input_tokens, m[0].max_rationale_tokens = 512, 0

    def encode(m):
        return [
            m.encode_document(texts["document"], batch_size=32, convert_to_tensor=True),
            m.encode(texts["default"], batch_size=32, convert_to_tensor=True),
        ]

    reference = encode(tuned)
    tuned_weights = tuned[0].model.state_dict()
    base_weights = {k: v.clone() for k, v in model[0].model.state_dict().items()}
    names = [
        n
        for n, m in tuned[0].model.named_modules()
        if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in TARGET_MODULES
    ]
    grams, _ = calibration_grams(tuned, names, args.config, 256, 0)
    spectra = {}
    for name in names:  # every rank's cut is a prefix of the whole spectrum
        u, s, right = delta_spectrum(tuned_weights[f"{name}.weight"] - base_weights[f"{name}.weight"], grams[name])
        spectra[name] = (u * s, right)

    def cosines(ranks: dict[str, int]) -> dict[str, float]:
        weights = model[0].model.state_dict()
        with torch.no_grad():
            for name in names:
                left, right = spectra[name]
                weights[f"{name}.weight"].copy_(
                    base_weights[f"{name}.weight"] + (left[:, : ranks[name]] @ right[: ranks[name]]).float()
                )
        found = encode(model)
        pairs = zip(("SciFact documents", "STS-B sentences"), found, reference)
        return {kind: float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean()) for kind, a, b in pairs}

    cost = {n: sum(tuned_weights[f"{n}.weight"].shape) for n in names}
    shares = [
        (float(v) / cost[n], n) for n in names for v in (spectra[n][0].norm(dim=0) ** 2 / (spectra[n][0] ** 2).sum())
    ]
    allocated, spent, budget = dict.fromkeys(names, 0), 0, args.budget_rank * sum(cost.values())
    for _, name in sorted(shares, reverse=True):
        if spent + cost[name] <= budget:
            allocated[name], spent = allocated[name] + 1, spent + cost[name]
    rows = [{"ranks": f"uniform {r}", **cosines(dict.fromkeys(names, r))} for r in args.ranks]
    rows.append({"ranks": f"allocated, rank {args.budget_rank}'s bytes", **cosines(allocated)})
    print("| ranks | SciFact documents | STS-B sentences (G = 0) |\n|---|---|---|")
    for row in rows:
        print(f"| {row['ranks']} | {row['SciFact documents']:.4f} | {row['STS-B sentences']:.4f} |")
    if args.out:
        args.out.write_text(json.dumps({"tuned": args.tuned, "rows": rows, "allocated": allocated}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
