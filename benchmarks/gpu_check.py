"""The GPU check (`make gpu-check`): what this CPU machine cannot prove, one command away.

On a machine with a CUDA GPU (the Makefile installs the ``vllm`` and ``training`` extras into
``.venv-gpu`` first), it runs each part in its own process (a vLLM engine keeps its GPU memory
until its process ends) and writes one JSON report:

  encode   the same texts encoded with the HF backend and with vLLM (greedy, float32 both, so
           the rationales should be the same tokens): 1 - cosine per text, rationales that
           agree, texts/s of each backend, measured in the same process.
  train    a few GRPO steps with vLLM rollouts (``rollout_backend: vllm``) on the default base
           model in bf16: seconds a step, the rollout share of a step, generated tokens/s and
           the time to sync the updated weights into the engine (from the run's metrics.jsonl).

Texts and triplets come from ../shared/data when it is there (STS-B dev sentences, STS-B train
pairs scored >= 4), else from the few sentences below. Without a CUDA GPU it says so in one line
and exits 2, before installing or loading anything.

    make gpu-check
    .venv-gpu/bin/python benchmarks/gpu_check.py --steps 5 --texts 256 --out benchmarks/results/gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
TOLERANCE = 1e-3  # max 1 - cosine accepted between the HF and vLLM embeddings of a text (float32)
PART_TIMEOUT_S = 3600  # a stuck engine must not hold `make gpu-check` forever

# Used only where ../shared/data is missing: a systems check, not a quality measurement.
SENTENCES = [
    "A man is playing a guitar on stage.",
    "Someone performs a song with an acoustic guitar.",
    "The central bank raised interest rates again.",
    "Stock markets fell after the rate decision.",
    "A woman is slicing an onion in the kitchen.",
    "Someone is cutting vegetables for dinner.",
    "Proteins fold into shapes that decide what they do in the cell.",
    "The structure of a protein determines its function.",
    "Two dogs are running through a snowy field.",
    "Puppies play outside in the snow.",
    "The train to Boston was delayed by an hour.",
    "Heavy rain flooded several streets downtown.",
]


def gpu_problem() -> str | None:
    """Why this machine cannot run the check, or None. Needs nothing beyond the standard library."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "no CUDA GPU on this machine (nvidia-smi not found)"
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"no usable CUDA GPU on this machine (nvidia-smi failed: {error})"
    if listed.returncode != 0 or "GPU" not in listed.stdout:
        return f"no CUDA GPU on this machine (nvidia-smi -L: {(listed.stderr or listed.stdout).strip()[:200]})"
    return None


def torch_problem() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed in this Python; run `make gpu-check`"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA GPU (a CPU build, or no driver)"
    return None


# -- data ------------------------------------------------------------------------------------------


def _data() -> Path:
    """../shared/data (or $GRACE_ST_DATA), as the dev scoreboard reads it; imported late: the
    preflight needs the standard library only."""
    from scoreboard import data_dir

    return data_dir()


def sentences(count: int) -> list[str]:
    dev = _data() / "stsb" / "dev.tsv"
    if not dev.is_file():
        return [SENTENCES[i % len(SENTENCES)] for i in range(count)]
    from scoreboard import sts_pairs

    first, second, _ = sts_pairs(dev, (count + 1) // 2)
    return [text for pair in zip(first, second) for text in pair][:count]


def train_data(workdir: Path) -> list[dict]:
    stsb = _data() / "stsb" / "train.tsv"
    if stsb.is_file():
        return [{"type": "pairs", "path": str(stsb), "threshold": 4.0, "max_examples": 512}]
    rows = []
    for i in range(0, len(SENTENCES), 2):
        negative = SENTENCES[(i + 2) % len(SENTENCES)]
        rows.append({"query": SENTENCES[i], "positive": SENTENCES[i + 1], "negatives": [negative]})
    path = workdir / "triplets.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows * 4), encoding="utf-8")
    return [{"type": "triplets", "path": str(path)}]


# -- the parts -------------------------------------------------------------------------------------


def compare_backends(model, texts: list[str], batch_size: int, tolerance: float = TOLERANCE, **vllm_kwargs) -> dict:
    """Encode ``texts`` greedily with the HF backend, then with vLLM; agreement and texts/s."""
    import numpy as np

    encoder = model[0]
    encoder.do_sample = False

    def timed() -> tuple[np.ndarray, float]:
        model.encode(texts[: min(len(texts), batch_size)], batch_size=batch_size)  # warm-up
        start = time.perf_counter()
        vectors = model.encode(texts, batch_size=batch_size, normalize_embeddings=True)
        return vectors, len(texts) / (time.perf_counter() - start)

    hf, hf_rate = timed()
    encoder.use_vllm(**vllm_kwargs)
    try:
        fast, vllm_rate = timed()
    finally:
        encoder.use_hf()
    distance = 1.0 - (hf * fast).sum(axis=1)
    within = distance <= tolerance
    return {
        "texts": len(texts),
        "batch_size": batch_size,
        "max_rationale_tokens": encoder.max_rationale_tokens,
        "max_one_minus_cosine": float(distance.max()),
        "mean_one_minus_cosine": float(distance.mean()),
        "texts_within_tolerance": int(within.sum()),
        "tolerance": tolerance,
        "hf_texts_per_s": hf_rate,
        "vllm_texts_per_s": vllm_rate,
        "vllm_speedup": vllm_rate / hf_rate,
        "passed": bool(within.all()),
    }


def encode_part(args) -> dict:
    import torch

    import grace_st

    path = args.model or grace_st.default_model_path(trained=False)
    model = grace_st.load(path, device="cuda").to(getattr(torch, args.dtype))
    model[0].max_rationale_tokens = args.budget
    report = compare_backends(
        model, sentences(args.texts), args.batch_size, args.tolerance, dtype=args.dtype, gpu_memory_utilization=0.4
    )
    return {"model": path, "gpu": torch.cuda.get_device_name(0), "dtype": args.dtype, **report}


def train_part(args) -> dict:
    import torch

    import grace_st
    from grace_training.config.train_config import GRPOConfig
    from grace_training.trainer import GRPOTrainer

    workdir = Path(tempfile.mkdtemp(prefix="grace-gpu-check-"))
    config = GRPOConfig(
        model_name_or_path=args.model or grace_st.default_model_path(trained=False),
        train_data=train_data(workdir),
        num_negatives=1,
        bad_rows="skip",
        num_rollouts=4,
        batch_size=8,
        max_input_tokens=128,
        max_rationale_tokens=args.budget,
        rollout_backend="vllm",
        vllm_gpu_memory_utilization=0.4,
        bf16=True,
        finetune="full",
        learning_rate=1e-6,
        max_steps=args.steps,
        save_steps=0,
        output_dir=str(workdir / "run"),
        report_to=["jsonl"],
    )
    GRPOTrainer(config).train()
    lines = [json.loads(line) for line in (workdir / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "time/step_s" in line]
    timed = steps[1:] or steps  # step 1 includes the engine's warm-up

    def mean(key: str) -> float:
        return statistics.fmean(line[key] for line in timed)

    return {
        "model": config.model_name_or_path,
        "gpu": torch.cuda.get_device_name(0),
        "steps": len(steps),
        "batch": f"{config.batch_size} triplets x {config.num_rollouts} rollouts, budget {config.max_rationale_tokens}",
        "first_step_s": steps[0]["time/step_s"],
        "step_s": mean("time/step_s"),
        "rollout_share": mean("time/rollout_share"),
        "generated_tokens_per_s": mean("throughput/generated_tokens_per_s"),
        "weight_sync_s": mean("time/weight_sync_s"),
        "reward_final": [line["reward/final"] for line in steps],
        "passed": bool(steps) and all(math.isfinite(line["loss"]) for line in steps),
    }


# -- driver ----------------------------------------------------------------------------------------


def run_part(name: str, args) -> dict:
    """One part in its own process; its report, or what went wrong."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = Path(handle.name)
    command = [sys.executable, __file__, "--part", name, "--part-out", str(out)]
    command += ["--steps", str(args.steps), "--texts", str(args.texts), "--budget", str(args.budget)]
    command += ["--batch-size", str(args.batch_size), "--dtype", args.dtype, "--tolerance", str(args.tolerance)]
    command += ["--model", args.model] if args.model else []
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PART_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"passed": False, "error": f"no result after {PART_TIMEOUT_S} s", "seconds": PART_TIMEOUT_S}
    seconds = time.perf_counter() - start
    if done.returncode != 0 or not out.stat().st_size:
        tail = (done.stderr or done.stdout).strip().splitlines()[-15:] or [f"exit {done.returncode}, no output"]
        return {"passed": False, "error": "\n".join(tail), "seconds": seconds}
    return {**json.loads(out.read_text()), "seconds": seconds}


def print_table(report: dict) -> None:
    encode, train = report["encode"], report["train"]
    print(f"\nGPU check on {report.get('gpu', '?')}")
    print("| part | result | numbers |\n|---|---|---|")
    if "error" in encode:
        print(f"| encode HF vs vLLM | FAILED | {encode['error'].splitlines()[-1]} |")
    else:
        print(
            f"| encode HF vs vLLM | {'ok' if encode['passed'] else 'MISMATCH'} | "
            f"{encode['texts_within_tolerance']}/{encode['texts']} texts within 1-cos <= {encode['tolerance']}, "
            f"max {encode['max_one_minus_cosine']:.2e}; HF {encode['hf_texts_per_s']:.1f} texts/s, "
            f"vLLM {encode['vllm_texts_per_s']:.1f} texts/s ({encode['vllm_speedup']:.1f}x) |"
        )
    if "error" in train:
        print(f"| GRPO, vLLM rollouts, bf16 | FAILED | {train['error'].splitlines()[-1]} |")
    else:
        print(
            f"| GRPO, vLLM rollouts, bf16 | {'ok' if train['passed'] else 'FAILED'} | {train['steps']} steps of "
            f"{train['batch']}: {train['step_s']:.2f} s/step (first {train['first_step_s']:.1f} s), rollout "
            f"{train['rollout_share']:.0%} of a step, {train['generated_tokens_per_s']:.0f} generated tokens/s, "
            f"weight sync {train['weight_sync_s'] * 1000:.0f} ms |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preflight", action="store_true", help="only check for a GPU (standard library only)")
    parser.add_argument("--model", help="a GRACE model directory (default: the embedded base)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--budget", type=int, default=32, help="rationale tokens (max)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="encode check, both backends (float32: same tokens)"
    )
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="max 1 - cosine (loosen for --dtype bfloat16)")
    parser.add_argument("--out", default=str(RESULTS / "gpu_check.json"))
    parser.add_argument("--part", choices=("encode", "train"), help=argparse.SUPPRESS)
    parser.add_argument("--part-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    problem = gpu_problem() or (None if args.preflight else torch_problem())
    if problem:
        print(f"gpu-check: {problem}; nothing to check here", file=sys.stderr)
        return 2
    if args.preflight:
        return 0
    if args.part:
        report = (encode_part if args.part == "encode" else train_part)(args)
        Path(args.part_out).write_text(json.dumps(report, indent=2), encoding="utf-8")
        return 0

    report = {"command": " ".join(sys.argv), "encode": run_part("encode", args), "train": run_part("train", args)}
    report["gpu"] = report["encode"].get("gpu") or report["train"].get("gpu")
    report["passed"] = report["encode"]["passed"] and report["train"]["passed"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2), encoding="utf-8")
    print_table(report)
    print(f"\nreport: {out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
