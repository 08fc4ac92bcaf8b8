"""Turn a LoRA training checkpoint into the adapter shipped inside grace-st (``grace_st/adapters/default``;
a GIRCSE checkpoint's into ``grace_st/adapters/gircse``, a GRC checkpoint's into ``grace_st/adapters/grc``).

    python -m grace_training.tools.export_adapter runs/scale_textkl1/checkpoint-00000400 --into-package \
        --scores dev_eval.json --scores-label "LABEL"   (any benchmarks/dev_eval.py JSON of the checkpoint)
    python -m grace_training.tools.export_adapter CHECKPOINT --out DIR       # anywhere else
    python -m grace_training.tools.export_adapter --write-manifest DIR       # after editing an adapter's files by hand

Writes PEFT's two files (``adapter_config.json``, ``adapter_model.safetensors``), a GRC checkpoint's
latents and their adapter A (``latent_tokens.safetensors``),
``grace_settings.json``: the encoder settings it was trained with (applied when
``grace_st.default_model_path()`` builds the trained default), the training config summary, the
development scores of that row when given, and one example rationale; and ``manifest.json``, the
sha256 of each, which ``default_model_path()`` checks before it builds. ``make train-default``
runs the recipe and then this.

The package's adapter is replaced only on request (``--into-package``; ``--out`` or nothing is
refused), only by one that fits the shipped base (SmolLM2-135M's layer shapes), and whole: the new
directory is written beside the old one and swapped in by renames, so a kill leaves the old adapter
or the new one, never a mix.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from grace_st.default_model import (
    ADAPTER_DIRS,
    ADAPTER_MANIFEST,
    ADAPTER_SETTINGS,
    DEFAULT_MODEL_CONFIG,
    write_adapter_manifest,
)
from grace_st.methods.grc import LATENT_FILE

SHIPPED_BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
# The shipped base's layer shapes (its config.json as grace_st.default_model builds it): enough to
# check an adapter's LoRA matrices without the 540 MB model.
SHIPPED_BASE_CONFIG = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}
MAX_BYTES = 20 * 1024 * 1024
# What an exported adapter directory holds; a target holding anything else is not replaced.
EXPORTED_FILES = ("adapter_config.json", "adapter_model.safetensors", LATENT_FILE, ADAPTER_SETTINGS, ADAPTER_MANIFEST)


def check_fits_shipped_base(weights_file: Path) -> None:
    """Refuse an adapter whose LoRA matrices do not fit SmolLM2-135M's linear layers (a test model's,
    another base's): shipped, it would fail only when a user first builds the default. The base is
    built on PyTorch's meta device from :data:`SHIPPED_BASE_CONFIG`: shapes, no weights."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from grace_st.files.adapter import check_adapter_fits

    with torch.device("meta"):
        base = LlamaForCausalLM(LlamaConfig(**SHIPPED_BASE_CONFIG))
    try:
        check_adapter_fits(base, load_file(str(weights_file)), weights_file.parent)
    except ValueError as error:
        raise SystemExit(f"{error}; the package's adapter must fit the shipped base, {SHIPPED_BASE}") from None


def _check_replaceable(out: Path) -> None:
    """``out`` is replaced whole: refuse a directory that holds anything an export does not write."""
    if out.exists() and not out.is_dir():
        raise SystemExit(f"{out} is a file; --out names the adapter directory to write")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in EXPORTED_FILES) if out.is_dir() else []
    if foreign:
        raise SystemExit(
            f"{out} holds {', '.join(foreign[:5])}, which is no exported adapter's: the export replaces the whole "
            "directory; give a new or an adapter directory"
        )


def _swap_in(staging: Path, out: Path) -> None:
    """Put the complete directory ``staging`` at ``out``: the old one renamed away, the new one renamed
    in, the old one deleted. A kill leaves the old adapter (under its name or beside it) or the new."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
    os.replace(staging, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def export(
    checkpoint: Path,
    out: Path,
    scores: dict | None = None,
    example: dict | None = None,
    bfloat16: bool = False,
    repetition_penalty: float | None = None,
    into_package: bool = False,
) -> Path:
    """``bfloat16``: store the LoRA matrices rounded to bfloat16 (half the bytes: an r 32 adapter of SmolLM2 fits the
    package's 20 MiB); they are read back into the float32 model, so score the exported adapter, not the checkpoint.
    ``repetition_penalty``: the decoding setting the default encodes with (training rolls out without one; the
    shipped value was chosen on dev data after training, decisions/D024); None leaves the encoder's default.
    ``into_package``: ``out`` may be one of the package's adapter directories (refused otherwise), and the adapter
    must fit the shipped base."""
    out = Path(out)
    shipped = {path.resolve() for path in ADAPTER_DIRS.values()}
    if out.resolve() in shipped and not into_package:
        raise SystemExit(f"{out} is the package's adapter, which every default model builds from: pass --into-package")
    adapter = checkpoint / "adapter_model.safetensors"
    if not adapter.is_file():
        raise SystemExit(f"{checkpoint}: no adapter_model.safetensors (train with finetune: lora)")
    size = adapter.stat().st_size // (2 if bfloat16 else 1)
    if size > MAX_BYTES:
        raise SystemExit(
            f"{adapter}: {size / 2**20:.1f} MiB{' in bfloat16' if bfloat16 else ''}, over the 20 MiB shipped in the package"
            + ("" if bfloat16 else " (--bfloat16 halves it)")
        )
    if into_package:
        check_fits_shipped_base(adapter)
    _check_replaceable(out)
    state = json.loads((checkpoint / "trainer_state" / "state.json").read_text(encoding="utf-8"))
    grace = json.loads((checkpoint / "grace_config.json").read_text(encoding="utf-8"))
    replaced = out / ADAPTER_SETTINGS
    # the budgets and why they are what they are come from a budget study, not from training: a new adapter keeps
    # both (measure its own curve, benchmarks/budget_curve.py, to choose again)
    previous = json.loads(replaced.read_text(encoding="utf-8")) if replaced.is_file() else {}
    budget_choice = previous.get("budget_choice")
    if budget_choice and "max_rationale_tokens" in previous.get("encoder", {}):
        grace = {**grace, "max_rationale_tokens": previous["encoder"]["max_rationale_tokens"]}
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.new-", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would become the adapter directory's
    try:
        _write(checkpoint, staging, adapter, state, grace, budget_choice, scores, example, bfloat16, repetition_penalty)
        write_adapter_manifest(staging)
        _swap_in(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _write(checkpoint, out, adapter, state, grace, budget_choice, scores, example, bfloat16, repetition_penalty):
    """The adapter's files, into the (new, empty) directory ``out``."""
    if bfloat16:
        import torch
        from safetensors.torch import load_file, save_file

        weights = {name: value.to(torch.bfloat16) for name, value in load_file(str(adapter)).items()}
        save_file(weights, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    else:
        shutil.copyfile(adapter, out / "adapter_model.safetensors")
    if (checkpoint / LATENT_FILE).is_file():  # GRC's latents and A are trained in full, not through LoRA
        shutil.copyfile(checkpoint / LATENT_FILE, out / LATENT_FILE)
    config = json.loads((checkpoint / "adapter_config.json").read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = SHIPPED_BASE  # replaced by the local base when the default is built
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    settings = {
        "encoder": {
            "method": grace.get("method", "grace"),
            "instructions": grace["instructions"],
            "max_rationale_tokens": grace["max_rationale_tokens"],
            **({"num_latent_tokens": grace["num_latent_tokens"]} if "num_latent_tokens" in grace else {}),
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


def _averaged_from(checkpoint: Path) -> dict:
    """Which checkpoints an averaged adapter (``average_adapters``) is the mean of; empty for one checkpoint."""
    from grace_training.tools.average_adapters import AVERAGED_FROM

    path = checkpoint / AVERAGED_FROM
    return {"averaged_from": json.loads(path.read_text(encoding="utf-8"))} if path.is_file() else {}


def _lowrank_from(checkpoint: Path) -> dict:
    """What a low-rank adapter (``lowrank_adapter``) approximates, at which rank, and how much it kept; empty for a
    trained adapter. ``training`` above is then the approximated model's last stage."""
    from grace_training.tools.lowrank_adapter import LOWRANK_FROM

    path = checkpoint / LOWRANK_FROM
    return {"lowrank_from": json.loads(path.read_text(encoding="utf-8"))} if path.is_file() else {}


def _slice_scores(state: dict) -> dict | None:
    """The checkpoint's own dev-slice scores (``eval/...`` at its step), named as such; None without any."""
    scores = {key.removeprefix("eval/"): value for key, value in (state.get("scores") or {}).items() if key.startswith("eval/")}
    return {f"dev slice at step {state['step']}: {key}": value for key, value in scores.items()} or None


def _summary(config: dict) -> dict:
    from grace_training.config.train_config import TrainConfig

    return TrainConfig.from_dict(config).summary()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, nargs="?")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--out", type=Path, help="the adapter directory to write (new, or an exported adapter's)")
    target.add_argument(
        "--into-package",
        action="store_true",
        help="replace the package's adapter of the checkpoint's method (grace_st/adapters/default, adapters/gircse, "
        "adapters/grc); "
        "it must fit the shipped base",
    )
    target.add_argument(
        "--write-manifest", type=Path, metavar="DIR",
        help="only (re)write DIR/manifest.json for the files DIR holds now (after a deliberate edit of them)",
    )
    parser.add_argument("--scores", type=Path, help="a dev_eval.py JSON")
    parser.add_argument("--scores-label", help="the row of --scores that scored this checkpoint")
    parser.add_argument("--compare-label", action="append", default=[], help="rows shown beside it (e.g. the base)")
    parser.add_argument("--bfloat16", action="store_true", help="store the adapter's matrices in bfloat16 (half the bytes)")
    parser.add_argument(
        "--repetition-penalty", type=float, help="the repetition_penalty the default decodes with (default: none, 1)"
    )
    args = parser.parse_args(argv)
    if args.write_manifest is not None:
        if args.checkpoint is not None:
            parser.error("--write-manifest takes a directory, not a checkpoint")
        if not (args.write_manifest / "adapter_model.safetensors").is_file():
            parser.error(f"--write-manifest {args.write_manifest}: no adapter_model.safetensors there")
        print(write_adapter_manifest(args.write_manifest))
        return 0
    if args.checkpoint is None:
        parser.error("give a checkpoint to export")
    if args.out is None and not args.into_package:
        parser.error("give --out DIR, or --into-package to replace the package's adapter")
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
    out = ADAPTER_DIRS[method] if args.into_package else args.out
    print(export(
        args.checkpoint, out, scores, example, bfloat16=args.bfloat16, repetition_penalty=args.repetition_penalty,
        into_package=args.into_package,
    ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
