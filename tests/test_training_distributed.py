"""Two CPU processes (accelerate + gloo) against one: same rewards, same weights, same resume.

Each run is the real ``grace-train`` in subprocesses: ``accelerate launch --multi_gpu
--num_processes 2`` on a machine without a GPU gives two processes over gloo (grace-train asks
accelerate for the CPU; ``--cpu`` alone would start one process, which is refused).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import CORPUS, make_st_model
from safetensors.torch import load_file

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="this torch build has no gloo backend",
)

# Compared per step: the rewards span the gathered batch (Eq. 7), the rest follow from them.
COMPARED = [
    "reward/contrastive",
    "reward/consistency",
    "reward/hard_negative",
    "reward/final",
    "reward/final_std_in_group",
    "advantage/std",
    "advantage/min",
    "advantage/max",
    "rollout/count",
    "loss",
    "loss/policy",
    "loss/contrastive",
    "grad_norm",
]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("distributed")
    make_st_model().save(str(root / "model"))
    with open(root / "train.jsonl", "w", encoding="utf-8") as handle:
        for i in range(8):
            row = {"query": CORPUS[i], "positive": CORPUS[i + 1], "negatives": [CORPUS[i + 2]]}
            handle.write(json.dumps(row) + "\n")
    config = {
        "model_name_or_path": str(root / "model"),
        "train_data": [{"type": "triplets", "path": str(root / "train.jsonl")}],
        "num_rollouts": 3,
        "batch_size": 4,  # global: two instances a process
        "num_negatives": 1,
        "max_input_tokens": 160,
        "max_rationale_tokens": 5,
        "learning_rate": 1e-3,
        "save_steps": 2,
        "report_to": ["jsonl"],
        "rollout_batch_size": 16,
    }
    (root / "config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    return root


def grace_train(
    root: Path, name: str, *overrides: str, processes: int = 1, launcher: list[str] | None = None,
    config: str = "config.yaml",
):
    """Run grace-train in ``processes`` CPU processes; returns (output_dir, completed process)."""
    output = root / name
    args = ["-m", "grace_training.cli", "--config", str(root / config), f"output_dir={output}", *overrides]
    if launcher is None and processes > 1:
        launcher = ["--multi_gpu", "--num_processes", str(processes)]
    if launcher is None:
        command = [sys.executable, *args]
    else:
        port = ["--main_process_port", str(_free_port())]
        command = [sys.executable, "-m", "accelerate.commands.launch", *launcher, *port, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    return output, done


def run_ok(root: Path, name: str, *overrides: str, processes: int = 1, config: str = "config.yaml") -> Path:
    output, done = grace_train(root, name, *overrides, processes=processes, config=config)
    assert done.returncode == 0, failure_report(done.stderr)
    return output


def failure_report(stderr: str) -> str:
    """Each process's own last lines, then the launcher's: the process that failed first is seldom
    the one whose error ends the output (the others only see it go)."""
    ranks: dict[str, list[str]] = {}
    for line in stderr.splitlines():
        if line.startswith("[rank"):
            ranks.setdefault(line.split("]", 1)[0] + "]", []).append(line)
    own = ["\n".join(lines[-25:]) for _, lines in sorted(ranks.items())]
    return "\n\n".join([*own, stderr[-2000:]])


def metrics(output: Path) -> list[dict]:
    lines = (output / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if "loss" in json.loads(line)]


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "model.safetensors"))


# How far two runs that differ only in float reduction order (process count, the CPU's kernels)
# may end apart: in L2, as a fraction of how far each tensor moved. Single elements are no
# measure: Adam divides each gradient by its own running RMS, so a near-zero gradient whose sign
# depends on the summation order becomes a step of up to ±lr in that element (one element of
# 12,800 ended 2.65e-5 apart on an AMD EPYC, where an absolute 2e-5 failed; 1.05e-4 on this
# machine at step 2). A real divergence (a gradient not all-reduced, a rollout drawn twice) moves
# whole tensors differently, tens of percent of their move.
REDUCTION_ORDER_TOLERANCE = 0.01


def assert_same_run(
    one: Path,
    two: Path,
    step: int,
    initial: dict | None = None,
    exact: bool = False,
    compared: list[str] = COMPARED,
    rel: float = 1e-4,
) -> None:
    """Same metrics each step (within ``rel``) and the same weights at ``step``: bit for bit when
    ``exact`` (a resumed run against a straight one: the same operations in the same order), else each
    tensor within REDUCTION_ORDER_TOLERANCE of its move from ``initial``, in L2."""
    first, second = ([m for m in metrics(run) if m["step"] <= step] for run in (one, two))
    assert [m["step"] for m in first] == [m["step"] for m in second] == list(range(1, step + 1))
    for a, b in zip(first, second):
        for key in compared:
            assert b[key] == pytest.approx(a[key], rel=rel, abs=1e-5), (a["step"], key)
    name = f"checkpoint-{step:08d}"
    expected, got = weights(one / name), weights(two / name)
    assert expected.keys() == got.keys()
    for key in expected:
        if exact:
            assert torch.equal(got[key], expected[key]), key
            continue
        moved = (expected[key] - initial.get(key, torch.zeros_like(expected[key]))).norm().item()
        apart = (got[key] - expected[key]).norm().item()
        assert apart <= REDUCTION_ORDER_TOLERANCE * moved + 1e-7, (key, apart, moved)


def test_two_processes_equal_one_and_a_resumed_run_equals_a_straight_one(workspace):
    """Two processes take the steps one takes, compared over two steps: with sampled rollouts a run
    is chaotic, and a float-order difference in the weights flips a sampled token now and then
    (seed 42, step 4, on this machine's CPU with the inverse-CDF sampler), after which the two runs
    are two valid, different runs. A resumed run repeats a straight one exactly, over four."""
    initial = weights(workspace / "model")
    one = run_ok(workspace, "one", "max_steps=4")
    two = run_ok(workspace, "two", "max_steps=4", processes=2)
    assert_same_run(one, two, step=2, initial=initial)
    # the weights moved: equality is not two runs that both did nothing
    moved = max((weights(one / "checkpoint-00000004")[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-4
    # one process wrote: one metrics line a step, both checkpoints whole, the sharded-state layout
    assert [m["step"] for m in metrics(two)] == [1, 2, 3, 4]
    state = two / "checkpoint-00000004" / "trainer_state"
    assert json.loads((state / "state.json").read_text())["step"] == 4
    assert sorted(p.name for p in (state / "accelerate").glob("random_states_*")) == [
        "random_states_0.pkl", "random_states_1.pkl"
    ]
    assert not list(two.glob(".tmp-*"))

    # interrupted after step 2's checkpoint, then resumed with two processes
    resumed = run_ok(workspace, "resumed", "max_steps=2", processes=2)
    output, done = grace_train(workspace, "resumed", "max_steps=4", "--resume", processes=2)
    assert done.returncode == 0, failure_report(done.stderr)
    assert "resumed from" in done.stderr and "checkpoint-00000002" in done.stderr
    assert output == resumed
    assert_same_run(two, resumed, step=4, exact=True)


def test_gircse_on_two_processes_takes_the_steps_of_one(workspace):
    """GIRCSE's stepwise InfoNCE (Eq. 7) and refinement term (Eq. 8) over the global batch from two
    processes: positives and hard negatives gathered with gradient (some triplets without a hard
    negative, so the processes hold different numbers), each L_k summed over both, the gradients
    averaged; the same losses and weights as one process holding the whole batch."""
    rows = [
        {"query": CORPUS[i], "positive": CORPUS[i + 1], "negatives": [CORPUS[i + 2]] if i % 3 else []}
        for i in range(8)
    ]
    (workspace / "gircse.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    config = yaml.safe_load((workspace / "config.yaml").read_text(encoding="utf-8"))
    for grpo_only in ("num_rollouts", "rollout_batch_size"):
        config.pop(grpo_only)
    config.update(
        algorithm="icr", max_rationale_tokens=3, train_data=[{"type": "triplets", "path": str(workspace / "gircse.jsonl")}]
    )
    (workspace / "gircse.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    # AdamW's ε far above every gradient makes its first step the gradient times a constant, so the
    # weights compare the gradients themselves; at ε 1e-8 the step is the gradient's sign, and an element
    # near zero flips with float order (REDUCTION_ORDER_TOLERANCE's note).
    steps = ["max_steps=2", "save_steps=1", "adam_epsilon=1000", "learning_rate=10"]
    one = run_ok(workspace, "gircse-one", *steps, config="gircse.yaml")
    two = run_ok(workspace, "gircse-two", *steps, processes=2, config="gircse.yaml")
    compared = ["loss", "loss/contrastive", "loss/refinement", "loss/step_1", "loss/step_3", "grad_norm"]
    assert_same_run(one, two, step=1, initial=weights(workspace / "model"), compared=compared)
    # At τ = 0.02 a loss is 50 times its cosines: the float-order difference in step 1's weights shows
    # in step 2's loss at about 1e-4 of it (3e-4 here), far below a gradient missing a process's share.
    assert metrics(two)[1]["loss"] == pytest.approx(metrics(one)[1]["loss"], rel=2e-3)
    assert metrics(two)[0]["loss/step_3"] > 0

    # scored pairs: CoSENT ranks every pair against every other, so both sides are gathered whole
    lines = ["score\tsentence1\tsentence2"] + [f"{i % 5}.0\t{CORPUS[i]}\t{CORPUS[i + 3]}" for i in range(8)]
    (workspace / "pairs.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    config.update(train_data=[{"type": "sts", "path": str(workspace / "pairs.tsv"), "symmetric": True}], batch_sampling="by_source")
    (workspace / "gircse-graded.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    one = run_ok(workspace, "graded-one", *steps, config="gircse-graded.yaml")
    two = run_ok(workspace, "graded-two", *steps, processes=2, config="gircse-graded.yaml")
    # CoSENT at τ = 0.02 makes a gradient norm in the thousands, and float order moves it by a few 1e-4
    # of itself (2.3e-4 on one machine's CPU, under 1e-4 on another's): the metrics within 1e-3, the
    # weights as tight as ever; a gradient missing a process's share is tens of percent off.
    assert_same_run(one, two, step=1, initial=weights(workspace / "model"), compared=compared, rel=1e-3)


@pytest.mark.parametrize("anchors", ["detached", "recompute"])
def test_the_hybrid_term_spans_the_processes_as_it_spans_chunks(workspace, anchors):
    """β > 0: two processes of one chunk each == one process of two chunks (exactly the same
    candidates, the same rows with gradient), so the pooled InfoNCE sees the global batch."""
    hybrid = ["max_steps=1", "contrastive_beta=0.5", f"contrastive_anchors={anchors}"]
    one = run_ok(workspace, f"hybrid-one-{anchors}", *hybrid, "gradient_accumulation_steps=2")
    two = run_ok(workspace, f"hybrid-two-{anchors}", *hybrid, processes=2)
    assert metrics(two)[0]["loss/contrastive"] > 0
    assert_same_run(one, two, step=1, initial=weights(workspace / "model"))


def test_launches_that_would_not_run_what_was_asked_are_refused(workspace):
    # --cpu starts one process whatever --num_processes says: refused, not trained alone
    # (--quiet: accelerate's launcher would add its own traceback for the child's exit code)
    _, done = grace_train(workspace, "cpu", "--dry-run", launcher=["--quiet", "--cpu", "--num_processes", "2"])
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "starts a single process" in done.stderr and "--multi_gpu" in done.stderr
    # an FSDP config on CPU: accelerate would run DDP instead; said, not done silently
    fsdp = workspace / "fsdp.yaml"
    fsdp.write_text(
        yaml.safe_dump(
            {
                "distributed_type": "FSDP",
                "num_processes": 2,
                "num_machines": 1,
                "mixed_precision": "no",
                "fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"},
            }
        ),
        encoding="utf-8",
    )
    _, done = grace_train(workspace, "fsdp", "max_steps=1", launcher=["--config_file", str(fsdp)])
    # torchrun reports the exit code with a traceback of its own; none runs through grace_training
    assert done.returncode != 0 and "grace_training/" not in done.stderr
    assert "grace-train: error: an FSDP launch, but accelerate set up MULTI_CPU" in done.stderr
    assert not (workspace / "fsdp" / "checkpoint-00000001").exists()


@pytest.mark.parametrize(
    "env, refused",
    [
        ({}, False),  # plain python
        ({"ACCELERATE_USE_CPU": "True"}, False),  # accelerate launch --cpu, one process
        ({"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1"}, True),  # --cpu --num_processes 2
        ({"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "OMPI_COMM_WORLD_SIZE": "2"}, False),  # mpirun
        ({"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, False),  # torchrun
    ],
)
def test_check_launch_tells_a_single_process_from_a_real_launch(env, refused):
    from grace_training.config.train_config import LaunchError, check_launch

    if refused:
        with pytest.raises(LaunchError, match="starts a single process"):
            check_launch(env)
    else:
        check_launch(env)


def test_fsdp_with_hf_rollouts_on_several_processes_is_refused():
    """Each process decodes its own rows: a sharded model's forwards would stop matching (a hang)."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from grace_training.config.train_config import ConfigError, TrainConfig
    from grace_training.run.processes import check_sharding as _check_sharding

    fsdp = SimpleNamespace(distributed_type=DistributedType.FSDP, num_processes=8)
    with pytest.raises(ConfigError, match="rollout_backend: hf cannot run under FSDP"):
        _check_sharding(fsdp, TrainConfig(rollout_backend="hf"))
    _check_sharding(fsdp, TrainConfig(rollout_backend="vllm"))
    _check_sharding(SimpleNamespace(distributed_type=DistributedType.FSDP, num_processes=1), TrainConfig())
    _check_sharding(SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, num_processes=2), TrainConfig())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
