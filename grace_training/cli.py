"""``grace-train``: training from a YAML config, by one of four algorithms: GRACE's GRPO, GIRCSE's ICR on soft tokens,
GRC's latent tokens (Eq. 5), or the InfoNCE yardstick (:mod:`grace_training.algorithms.registry`).

grace-train --config grace_training/configs/cpu_smollm2.yaml                 # train
grace-train --config FILE max_steps=10 output_dir=runs/x              # key=value overrides
grace-train --config FILE --resume                                    # continue the latest checkpoint
grace-train --config FILE --resume --max-minutes 55                   # one chunk of a long run
grace-train --config FILE --stop-at-step 100                          # a point of a longer run (its schedule, its data order)
grace-train --config FILE --resume --allow-config-change num_rollouts=4  # change what a resumed run trains
grace-train --config FILE --overwrite-output-dir                      # start over where an earlier run is
grace-train --config FILE --dry-run                                   # validate, print the plan
grace-train --config FILE --algorithm infonce output_dir=runs/infonce    # the "w/ CL" baseline
grace-train --config FILE --algorithm infonce output_dir=runs/infonce --resume --max-minutes 55  # its next chunk
grace-train --config grace_training/configs/gircse_smollm2.yaml         # GIRCSE (algorithm: icr)
grace-train --config grace_training/configs/grc_smollm2.yaml            # GRC (algorithm: grc)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from grace_training.algorithms.registry import ALGORITHMS, current_name
from grace_training.config.train_config import (
    ConfigError,
    LaunchError,
    TrainConfig,
    check_batches,
    check_environment,
    check_launch,
    locate,
)
from grace_training.data.examples import cap_per_source, load_data
from grace_training.policy import ModelLoadError, check_model_source
from grace_training.run.checkpoint import CheckpointError
from grace_training.run.run_dir import ConfigChangeError, OutputDirError, claim_output_dir, inspect_output_dir


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grace-train", description="GRACE GRPO training (contrastive rewards).")
    parser.add_argument("--config", required=True, help="YAML file with TrainConfig keys")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (values parsed as YAML)")
    parser.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="CHECKPOINT",
        help="continue from the latest checkpoint of the run in output_dir (or the one given); keys that change "
        "what is trained must match the checkpoint's config (see --allow-config-change)",
    )
    parser.add_argument(
        "--overwrite-output-dir",
        action="store_true",
        help="start although output_dir is not empty: an earlier grace-train run there is deleted first (its "
        "checkpoints, metrics, config and marker); in a directory that is not a run, the run's own file names "
        "(config.yaml, metrics.jsonl, ...) are replaced and nothing else is deleted. Without it, such a "
        "directory is refused. System and package directories are refused always",
    )
    parser.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: apply keys that change what is trained (learning_rate, num_rollouts, temperatures, "
        "seed, batch_size, data, ...) from the next step, optimizer included, and record each in "
        "config_changes.jsonl; without it they are refused. finetune, lora_r, lora_alpha, lora_target_modules, "
        "model_name_or_path and objective never change in a resumed run",
    )
    parser.add_argument("--dry-run", action="store_true", help="validate the config and data, print the plan, exit")
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        metavar="M",
        help="train one chunk: stop at the first step that ends after M minutes, with a checkpoint; "
        "--resume continues it (long runs in chunks, e.g. 55 for sessions of an hour)",
    )
    parser.add_argument(
        "--stop-at-step",
        type=int,
        default=None,
        metavar="N",
        help="stop at step N with a checkpoint, short of max_steps: the run's schedule and data order stay those of "
        "max_steps (a model taken part-way through a longer run, as decisions/D028 took the yardstick at 455 of "
        "1000 steps); --resume continues it",
    )
    parser.add_argument(
        "--algorithm",
        choices=ALGORITHMS,
        default=None,
        help="; ".join(f"{name}: {record.summary.split(':')[0]}" for name, record in ALGORITHMS.items())
        + " (docs/training.md, Algorithms); default: the config's algorithm",
    )
    parser.add_argument(
        "--method", choices=("grpo", "gircse", "infonce"), default=None, help="the old name of --algorithm (gircse: icr)"
    )
    return parser


def _instructions(model_path: str) -> dict[str, str]:
    from grace_st.prompts import DEFAULT_INSTRUCTIONS

    config_file = Path(model_path) / "grace_config.json"
    if config_file.is_file():
        saved = json.loads(config_file.read_text(encoding="utf-8")).get("instructions") or {}
        return {**DEFAULT_INSTRUCTIONS, **saved}
    return dict(DEFAULT_INSTRUCTIONS)


def plan(config: TrainConfig, sample: int = 256) -> dict[str, Any]:
    """Steps, rollouts per step and expected tokens, from the data and the tokenizer alone."""
    from transformers import AutoTokenizer

    import grace_st
    from grace_st.prompts import build_prompt_template, tokenize_texts

    rows, issues = load_data(config.train_data, objective=config.objective, **config.data_settings())
    # the real run refuses it at the same point, before the model; WORLD_SIZE is set under `accelerate launch`
    check_batches(config, len(rows), int(os.environ.get("WORLD_SIZE", "1")))
    eval_rows, eval_issues = load_data(config.eval_data, **config.data_settings()) if config.eval_data else ([], [])
    model_path = config.model_name_or_path or grace_st.default_model_path(trained=False)
    check_model_source(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    instructions = _instructions(model_path)

    def prompt_tokens(texts: list[str], task: str) -> float:
        if not texts:
            return 0.0
        template = build_prompt_template(tokenizer, instructions.get(task, instructions["default"]))
        budget = config.max_input_tokens - len(template.prefix_ids) - len(template.suffix_ids)
        if budget < 0:
            raise ValueError(f"the {task!r} instruction and chat template alone exceed max_input_tokens")
        return statistics.mean(len(template.build(ids[:budget])) for ids in tokenize_texts(tokenizer, texts))

    import random

    head = random.Random(config.seed).sample(rows, min(sample, len(rows)))
    negatives_per = statistics.mean(min(len(r.negatives), config.num_negatives) for r in head) if head else 0.0
    query_len = prompt_tokens([r.query for r in head], config.query_task)
    doc_len = prompt_tokens(
        [r.positive for r in head] + [n for r in head for n in r.negatives[: config.num_negatives]],
        config.document_task,
    )
    steps_per_epoch = len(rows) // config.batch_size
    total = config.max_steps if config.max_steps > 0 else config.epochs * steps_per_epoch
    b, k = config.batch_size, config.num_rollouts
    rollouts = b * (1 + k + negatives_per)
    sources: dict[str, int] = {}
    for row in rows:
        sources[row.source] = sources.get(row.source, 0) + 1
    return {
        "model": model_path,
        "objective": config.objective,
        "instances": len(rows),
        "instances_by_source": sources,
        "bad_rows": len(issues) + len(eval_issues),
        "eval_instances": len(cap_per_source(eval_rows, config.eval_max_examples, config.eval_seed)),
        "steps_per_epoch": steps_per_epoch,
        "total_steps": total,
        "rollouts_per_step": rollouts,
        "positive_rollouts_per_step": b * k,
        "mean_prompt_tokens": {"query": round(query_len, 1), "document": round(doc_len, 1)},
        "prompt_tokens_per_step": round(b * (query_len + negatives_per * doc_len + k * doc_len)),
        "max_generated_tokens_per_step": round(rollouts * config.longest_response),
        "max_trained_tokens_per_step": round(b * k * (doc_len + config.longest_response + 1)),
        "max_generated_tokens_total": round(rollouts * config.longest_response * total),
        "checkpoints": len({*range(config.save_steps, total, config.save_steps or total + 1), total}),
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.stop_at_step is not None and args.stop_at_step < 1:
        return _refuse(f"--stop-at-step {args.stop_at_step}: give a step of at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        overrides = list(args.overrides)
        algorithm = _algorithm(args)
        if algorithm is not None:
            overrides.append(f"algorithm={algorithm}")
        config = TrainConfig.from_yaml(args.config, overrides)
        check_environment(config)
        check_launch()
    except ConfigError as error:
        return _refuse(f"bad config: {locate(error, args.config, args.overrides)}")
    except LaunchError as error:
        return _refuse(str(error))
    directory = {"algorithm": config.algorithm, "resume": bool(args.resume), "overwrite": args.overwrite_output_dir}
    if args.dry_run:
        try:
            summary = plan(config)
            inspect_output_dir(config.output_dir, **directory)
        except ConfigError as error:
            return _refuse(f"bad config: {locate(error, args.config, args.overrides)}")
        except ModelLoadError as error:
            return _refuse(str(error), code=1)
        except (ValueError, OSError, OutputDirError) as error:  # data files: a bad row, a missing file or folder
            return _refuse(str(error))
        print(json.dumps({"config": config.to_dict(), "plan": summary}, indent=2))
        return 0
    if config.algorithm == "infonce":
        return _train_infonce(config, directory, args.max_minutes, args.resume, args.stop_at_step)
    from grace_training.trainer import Trainer

    try:
        # before any model loads (the trainer checks again, with the run's last step, when it starts)
        inspect_output_dir(config.output_dir, **directory, last_step=config.max_steps if config.max_steps > 0 else None)
        trainer = Trainer(
            config, overwrite_output_dir=args.overwrite_output_dir, allow_config_change=args.allow_config_change
        )
        result = trainer.train(resume=args.resume, max_minutes=args.max_minutes, stop_at_step=args.stop_at_step)
    except ConfigError as error:  # what only the data or the process count shows (the dry run shows it too)
        return _refuse(f"bad config: {locate(error, args.config, args.overrides)}")
    except CheckpointError as error:  # --resume with no loadable checkpoint: not a crash, a decision to make
        return _refuse(str(error), code=1)
    except ModelLoadError as error:  # a missing path, a broken model: one line, not a traceback
        return _refuse(str(error), code=1)
    except (LaunchError, OutputDirError, ConfigChangeError) as error:  # FSDP where DDP would run; the run's directory
        return _refuse(str(error))
    print(json.dumps({"step": result["step"], "scores": result["scores"]}, indent=2))
    return 0


def _algorithm(args: argparse.Namespace) -> str | None:
    """``--algorithm``, or the old ``--method`` (with a warning); None: the config's."""
    if args.method is None:
        return args.algorithm
    algorithm = current_name(args.method)
    if args.algorithm not in (None, algorithm):
        raise ConfigError(f"--method {args.method} (the old name of --algorithm) and --algorithm {args.algorithm} disagree")
    logging.getLogger(__name__).warning("--method is now called --algorithm (--algorithm %s)", algorithm)
    return algorithm


def _train_infonce(
    config: TrainConfig,
    directory: dict[str, Any],
    max_minutes: float | None,
    resume: bool | str,
    stop_at_step: int | None = None,
) -> int:
    """The InfoNCE baseline, in a directory it owns as a GRPO run does; ``--max-minutes`` ends a chunk
    with a checkpoint and ``--resume`` goes on from it."""
    from grace_training.algorithms.infonce.train import resume_checkpoint, train_infonce

    try:
        checkpoint = resume_checkpoint(config.output_dir, resume)  # refused before the directory is claimed
        if config.model_name_or_path:  # so is a start model that is not there
            check_model_source(config.model_name_or_path)
    except (CheckpointError, ModelLoadError) as error:
        return _refuse(str(error), code=1)
    try:
        if os.environ.get("RANK", "0") == "0":  # under `accelerate launch`, one process takes it
            claim_output_dir(config.output_dir, **directory)
    except OutputDirError as error:
        return _refuse(str(error))
    try:
        path = train_infonce(
            config,
            max_minutes=max_minutes,
            resume=str(checkpoint[0]) if checkpoint else False,
            stop_at_step=stop_at_step,
        )
    except ModelLoadError as error:
        return _refuse(str(error), code=1)
    print(f"InfoNCE baseline saved to {path}")
    return 0


def _refuse(message: str, code: int = 2) -> int:
    """argparse's convention: ``prog: error: ...`` on stderr, exit 2 for what the user must fix."""
    print(f"grace-train: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
