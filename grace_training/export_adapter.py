"""Turn a LoRA training checkpoint into the adapter shipped inside grace-st (``grace_st/default_adapter``;
a GIRCSE checkpoint's into ``grace_st/gircse_adapter``).

    python -m grace_training.export_adapter runs/scale_textkl1/checkpoint-00000400 \
        --scores lab/results/scale_scoreboard_textkl400.json --scores-label "scale + text_kl 1, step 400"

Writes PEFT's two files (``adapter_config.json``, ``adapter_model.safetensors``) and
``grace_settings.json``: the encoder settings it was trained with (applied when
``grace_st.default_model_path()`` builds the trained default), the training config summary, the
development scores of that row when given, and one example rationale. ``make train-default``
runs the recipe and then this.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from grace_st.default_model import ADAPTER_DIRS, ADAPTER_SETTINGS, DEFAULT_MODEL_CONFIG

SHIPPED_BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
MAX_BYTES = 20 * 1024 * 1024


def export(
    checkpoint: Path,
    out: Path,
    scores: dict | None = None,
    example: dict | None = None,
    bfloat16: bool = False,
    repetition_penalty: float | None = None,
) -> Path:
    """``bfloat16``: store the LoRA matrices rounded to bfloat16 (half the bytes: an r 32 adapter of SmolLM2 fits the
    package's 20 MiB); they are read back into the float32 model, so score the exported adapter, not the checkpoint.
    ``repetition_penalty``: the decoding setting the default encodes with (training rolls out without one; the
    shipped value was chosen on dev data after training, lab/training_recipe.md §21); None leaves the encoder's default."""
    adapter = checkpoint / "adapter_model.safetensors"
    if not adapter.is_file():
        raise SystemExit(f"{checkpoint}: no adapter_model.safetensors (train with finetune: lora)")
    size = adapter.stat().st_size // (2 if bfloat16 else 1)
    if size > MAX_BYTES:
        raise SystemExit(
            f"{adapter}: {size / 2**20:.1f} MiB{' in bfloat16' if bfloat16 else ''}, over the 20 MiB shipped in the package"
            + ("" if bfloat16 else " (--bfloat16 halves it)")
        )
    state = json.loads((checkpoint / "trainer_state" / "state.json").read_text(encoding="utf-8"))
    grace = json.loads((checkpoint / "grace_config.json").read_text(encoding="utf-8"))
    replaced = out / ADAPTER_SETTINGS
    # why the budgets are what they are is written from a budget study, not by training: a new adapter keeps it
    budget_choice = (
        json.loads(replaced.read_text(encoding="utf-8")).get("budget_choice") if replaced.is_file() else None
    )
    out.mkdir(parents=True, exist_ok=True)
    if bfloat16:
        import torch
        from safetensors.torch import load_file, save_file

        weights = {name: value.to(torch.bfloat16) for name, value in load_file(str(adapter)).items()}
        save_file(weights, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    else:
        shutil.copyfile(adapter, out / "adapter_model.safetensors")
    config = json.loads((checkpoint / "adapter_config.json").read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = SHIPPED_BASE  # replaced by the local base when the default is built
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    settings = {
        "encoder": {
            "method": grace.get("method", "grace"),
            "instructions": grace["instructions"],
            "max_rationale_tokens": grace["max_rationale_tokens"],
            # the default's prompt limit; training cut prompts shorter only to save time
            "max_input_tokens": DEFAULT_MODEL_CONFIG["max_input_tokens"],
            **({} if repetition_penalty is None else {"repetition_penalty": repetition_penalty}),
        },
        "training": {
            **_summary(state["config"]),
            "step": state["step"],
            **_averaged_from(checkpoint),
            **_lowrank_from(checkpoint),
        },
        # the dev scoreboard's row when given; else the dev slice the run scored at this step (eval_data)
        "scores": scores or _slice_scores(state),
        # a rationale the shipped model writes (dev_eval records some), else one from training
        "example": example or state.get("example"),
        **({"budget_choice": budget_choice} if budget_choice else {}),
    }
    (out / ADAPTER_SETTINGS).write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out


def _averaged_from(checkpoint: Path) -> dict:
    """Which checkpoints an averaged adapter (``average_adapters``) is the mean of; empty for one checkpoint."""
    from .average_adapters import AVERAGED_FROM

    path = checkpoint / AVERAGED_FROM
    return {"averaged_from": json.loads(path.read_text(encoding="utf-8"))} if path.is_file() else {}


def _lowrank_from(checkpoint: Path) -> dict:
    """What a low-rank adapter (``lowrank_adapter``) approximates, at which rank, and how much it kept; empty for a
    trained adapter. ``training`` above is then the approximated model's last stage."""
    from .lowrank_adapter import LOWRANK_FROM

    path = checkpoint / LOWRANK_FROM
    return {"lowrank_from": json.loads(path.read_text(encoding="utf-8"))} if path.is_file() else {}


def _slice_scores(state: dict) -> dict | None:
    """The checkpoint's own dev-slice scores (``eval/...`` at its step), named as such; None without any."""
    scores = {key.removeprefix("eval/"): value for key, value in (state.get("scores") or {}).items() if key.startswith("eval/")}
    return {f"dev slice at step {state['step']}: {key}": value for key, value in scores.items()} or None


def _summary(config: dict) -> dict:
    from .config import GRPOConfig

    return GRPOConfig.from_dict(config).summary()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument(
        "--out", type=Path, help="default: the package's adapter directory of the checkpoint's method (grace_st/default_adapter, gircse_adapter)"
    )
    parser.add_argument("--scores", type=Path, help="a dev_eval.py / quality_study.py JSON")
    parser.add_argument("--scores-label", help="the row of --scores that scored this checkpoint")
    parser.add_argument("--compare-label", action="append", default=[], help="rows shown beside it (e.g. the base)")
    parser.add_argument("--bfloat16", action="store_true", help="store the adapter's matrices in bfloat16 (half the bytes)")
    parser.add_argument(
        "--repetition-penalty", type=float, help="the repetition_penalty the default decodes with (default: none, 1)"
    )
    args = parser.parse_args(argv)
    scores = example = None
    if args.scores:
        rows = {row["label"]: row for row in json.loads(args.scores.read_text(encoding="utf-8"))["rows"]}
        missing = [label for label in [args.scores_label, *args.compare_label] if label not in rows]
        if missing:
            print(f"no row {missing} in {args.scores}", file=sys.stderr)
            return 2
        scores = {k: v for k, v in rows[args.scores_label]["scores"].items() if v is not None}
        example = (rows[args.scores_label].get("examples") or [None])[0]
        for label in args.compare_label:
            scores.update({f"{k} — {label}": v for k, v in rows[label]["scores"].items() if v is not None})
    method = json.loads((args.checkpoint / "grace_config.json").read_text(encoding="utf-8")).get("method", "grace")
    out = args.out or ADAPTER_DIRS[method]
    print(export(args.checkpoint, out, scores, example, bfloat16=args.bfloat16, repetition_penalty=args.repetition_penalty))
    return 0


if __name__ == "__main__":
    sys.exit(main())
