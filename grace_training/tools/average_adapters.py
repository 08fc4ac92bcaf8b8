"""Average the LoRA adapters of several checkpoints of one run: weight averaging along a trajectory
(SWA, Izmailov et al. 2018), the cheap last stage tried when the dev curve has gone flat within the
noise between neighbouring checkpoints (decisions/D019). With ``--rank`` the sources may also be
the last checkpoints of different runs on the same base, at different LoRA ranks: a uniform model
soup (Wortsman et al. 2022), fine-tuned solutions from one pretrained point averaged in weight space.
Every source's delta is applied to the base the last source names (the packaged adapter names the Hub
id of the base that the checkpoints name as its local copy).

    python -m grace_training.tools.average_adapters runs/cont_lr1e-4/checkpoint-00000025 \
        runs/cont_lr1e-4/checkpoint-00000050 ... --out runs/average_400_600

What is averaged is each layer's weight delta ΔW = (α/r)·B·A, exactly (a mean of products, not a
product of means), then cut back to ``--rank`` by SVD so that the result is an ordinary LoRA adapter
of the shipped size: PEFT's ``add_weighted_adapter`` with ``combination_type="svd"`` does both. The
relative Frobenius error of that cut is measured and printed.

The output is a checkpoint directory like the last source's (a sentence-transformers model:
``dev_eval.py PATH@saved`` scores it, ``export_adapter`` ships it) with the averaged adapter and
``averaged_from.json``, which lists the sources; it has no optimizer state, so nothing resumes from it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from grace_st.files.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_base, record_learned_state
from grace_training.run.checkpoint import TRAINING_FILES

AVERAGED_FROM = "averaged_from.json"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)


def average_adapters(sources: list[Path], out: Path, rank: int | None = None) -> dict:
    """Write the mean of the sources' LoRA weight deltas, cut to ``rank``, into ``out``; return a summary."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    missing = [str(source) for source in sources if not all((source / name).is_file() for name in ADAPTER_FILES)]
    if missing:
        raise SystemExit(
            f"not a LoRA checkpoint or adapter directory (no {' / '.join(ADAPTER_FILES)}): {', '.join(missing)}"
        )
    if len(sources) < 2:
        raise SystemExit("give at least two checkpoints to average")
    template = sources[-1]
    if not (template / "modules.json").is_file():
        raise SystemExit(
            f"{template}: the last source must be a training checkpoint (a saved model), not a bare adapter"
        )
    base_path, _ = adapter_base(template)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    names = [f"source_{i}" for i in range(len(sources))]
    model = PeftModel.from_pretrained(base, str(sources[0]), adapter_name=names[0])
    for name, source in zip(names[1:], sources[1:]):
        model.load_adapter(str(source), adapter_name=name)
    ranks = {model.peft_config[name].r for name in names}
    if len(ranks) != 1 and rank is None:
        raise SystemExit(
            f"the sources have different LoRA ranks {sorted(ranks)}: give --rank for the average (a soup of runs)"
        )
    rank = rank or ranks.pop()
    model.add_weighted_adapter(names, [1 / len(names)] * len(names), "average", combination_type="svd", svd_rank=rank)
    error, spread = _distances(model, names, "average")

    # the optimizer, scheduler and RNG state belong to one point of the run, not to an average of several
    shutil.copytree(template, out, dirs_exist_ok=False, ignore=shutil.ignore_patterns(*TRAINING_FILES))
    saved = out / "_average"
    # the embeddings are not adapted; without this PEFT looks the base up on the Hub to check its vocabulary
    model.save_pretrained(str(saved), selected_adapters=["average"], save_embedding_layers=False)
    for name in ADAPTER_FILES:
        shutil.move(str(saved / "average" / name), out / name)
    shutil.rmtree(saved)
    config = json.loads((out / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = base_path
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    record_learned_state(out)  # the copied record is the last source's adapter's
    summary = {
        "sources": [str(source) for source in sources],
        "rank": rank,
        "relative_cut_error": error,
        # how far each source is from the mean, relative to the mean: how much there was to average
        "relative_distance_to_mean": spread,
    }
    (out / AVERAGED_FROM).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    card = out / "README.md"
    if card.is_file():  # the copied card describes the last source; say what this directory is
        note = f"\n## Averaged adapter\n\nThe LoRA adapter here is the mean of {len(sources)} checkpoints' weight deltas (`{AVERAGED_FROM}`).\n"
        card.write_text(card.read_text(encoding="utf-8") + note, encoding="utf-8")
    return summary


@torch.no_grad()
def _distances(model, names: list[str], averaged: str) -> tuple[float, list[float]]:
    """Over all adapted layers, relative to ‖mean ΔW‖: what the SVD cut to rank r lost
    (‖mean ΔW − ΔW_average‖), and each source's distance to the mean (‖ΔW_i − mean ΔW‖)."""
    from peft.tuners.lora import LoraLayer

    cut = total = 0.0
    spread = [0.0] * len(names)
    for module in model.modules():
        if isinstance(module, LoraLayer) and averaged in module.lora_A:
            deltas = [module.get_delta_weight(name) for name in names]
            mean = sum(deltas) / len(deltas)
            cut += float((mean - module.get_delta_weight(averaged)).pow(2).sum())
            total += float(mean.pow(2).sum())
            spread = [s + float((delta - mean).pow(2).sum()) for s, delta in zip(spread, deltas)]
    if not total:  # adapters that never moved from PEFT's zero B: nothing to measure against
        return 0.0, [0.0] * len(names)
    return (cut / total) ** 0.5, [round((s / total) ** 0.5, 4) for s in spread]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "sources",
        type=Path,
        nargs="+",
        help="checkpoints (or adapter directories) of one run, or of runs on one base with --rank; the last must be a checkpoint",
    )
    parser.add_argument("--out", type=Path, required=True, help="a new directory")
    parser.add_argument(
        "--rank",
        type=int,
        help="LoRA rank of the average (default: the sources' rank, the shipped size; required when their ranks differ)",
    )
    args = parser.parse_args(argv)
    summary = average_adapters(args.sources, args.out, args.rank)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
