"""Fixed tiny GRPO, ICR and GRC runs, as per-step losses and weight digests: run it under two
code versions and compare the JSON files to show a refactor changed no training number.

    python benchmarks/training_digest.py --out now.json
    PYTHONPATH=OLD_TREE python benchmarks/training_digest.py --out old.json --compare now.json   # the old code

The model is the test suite's tiny random Llama (``tests/conftest.py``: nothing downloaded), trained on CPU
for a few steps with LoRA: GRPO with its hybrid InfoNCE term and a text KL term (method.md §2), GIRCSE's
iterative contrastive refinement (gircse.md §3) and GRC's three losses (grc.md Eq. 5). Each run's metrics per step
and the sha256 of its final LoRA weights (and GRC's latent tokens) are recorded; ``--compare`` checks every loss to
1e-6 and every weight digest for equality. The runs use keys every version reads (``method: gircse``, the old name of ``algorithm: icr``, names the ICR run).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

import grace_st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conftest import CORPUS, make_st_model

from grace_training.config.train_config import GRPOConfig
from grace_training.data.examples import Triplet
from grace_training.trainer import GRPOTrainer

DATA = [Triplet(CORPUS[i], CORPUS[i + 1], (CORPUS[i + 2],), "toy") for i in range(8)]
COMMON = {
    "batch_size": 2,
    "num_negatives": 1,
    "max_input_tokens": 160,
    "learning_rate": 1e-2,
    "max_steps": 4,
    "save_steps": 0,
    "report_to": ["jsonl"],
    "finetune": "lora",
    "seed": 7,
}
RUNS = {
    "grpo": {"num_rollouts": 3, "max_rationale_tokens": 5, "contrastive_beta": 0.5, "text_kl_coef": 0.1},
    "icr": {"method": "gircse", "max_rationale_tokens": 3},
    "grc": {"algorithm": "grc", "max_rationale_tokens": {"default": 2, "query": 2, "document": 0}, "num_latent_tokens": 3},
}


def run(name: str, settings: dict, out: Path) -> dict:
    torch.manual_seed(0)
    base = make_st_model()  # a LoRA adapter needs a base it can name: saved, then loaded from there
    base[0].model.save_pretrained(out / "base")
    base[0].tokenizer.save_pretrained(out / "base")
    model = grace_st.from_causal_lm(str(out / "base"), max_rationale_tokens=8, device="cpu")
    config = GRPOConfig.from_dict({**COMMON, **settings, "output_dir": str(out / name)})
    started = time.perf_counter()
    GRPOTrainer(config, model=model, train_data=DATA).train()
    seconds = time.perf_counter() - started
    lines = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    losses = {
        str(line["step"]): {k: v for k, v in line.items() if k.startswith("loss") or k.startswith("reward/")}
        for line in lines
        if "loss" in line
    }
    state = model[0].model.state_dict()
    weights = hashlib.sha256()
    for key in sorted(state):
        if "lora_" in key:
            weights.update(key.encode() + state[key].detach().float().contiguous().numpy().tobytes())
    latents = getattr(model[0], "latent_tokens", None)
    for key, tensor in sorted((latents.state_dict() if latents is not None else {}).items()):
        weights.update(key.encode() + tensor.detach().float().contiguous().numpy().tobytes())
    return {"losses": losses, "weights_sha256": weights.hexdigest(), "seconds": seconds}


def compare(found: dict, earlier: dict) -> bool:
    same = True
    for name, result in found.items():
        if name not in earlier:
            print(f"{name}: not in {sorted(earlier)}")
            same = False
            continue
        before = earlier[name]
        for step, values in result["losses"].items():
            for key, value in values.items():
                if abs(value - before["losses"][step][key]) > 1e-6:
                    print(f"{name} step {step} {key}: {before['losses'][step][key]} -> {value}")
                    same = False
        if result["losses"].keys() != before["losses"].keys():
            print(f"{name}: steps {sorted(before['losses'])} -> {sorted(result['losses'])}")
            same = False
        if result["weights_sha256"] != before["weights_sha256"]:
            print(f"{name}: final LoRA weights differ")
            same = False
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON: per-step losses and weight digests of each run")
    parser.add_argument("--compare", help="an earlier --out file to check against")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    with tempfile.TemporaryDirectory() as tmp:
        found = {name: run(name, settings, Path(tmp)) for name, settings in RUNS.items()}
    Path(args.out).write_text(json.dumps(found, indent=1))
    for name, result in found.items():
        last = result["losses"][max(result["losses"], key=int)]
        print(
            f"{name:<5} {len(result['losses'])} steps  last loss {last['loss']:.6f}  weights {result['weights_sha256'][:16]}  {result['seconds']:.1f} s"
        )
    if args.compare:
        same = compare(found, json.loads(Path(args.compare).read_text()))
        print("identical" if same else "DIFFERENT")
        sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
