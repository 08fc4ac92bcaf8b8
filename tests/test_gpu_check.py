"""`make gpu-check` without a GPU refuses in one line; its encode comparison runs on a vLLM stand-in."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CORPUS, load_benchmark, make_st_model
from sentence_transformers import SentenceTransformer
from test_vllm_backend import _FakeLLM, fake_vllm  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _without_nvidia_smi() -> dict[str, str]:
    """PATH without any nvidia-smi (a machine with no NVIDIA driver)."""
    folders = [p for p in os.environ.get("PATH", "").split(os.pathsep) if not (Path(p) / "nvidia-smi").exists()]
    return {**os.environ, "PATH": os.pathsep.join(folders)}


@pytest.mark.parametrize("args", [["--preflight"], []])
def test_the_check_refuses_in_one_line_without_a_gpu(args):
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=_without_nvidia_smi())
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["gpu-check: no CUDA GPU on this machine (nvidia-smi not found); nothing to check here"]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_gpu_check_installs_nothing_without_a_gpu(tmp_path):
    # a copy of what the target needs, so a refusal cannot touch the checkout
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    shutil.copy(SCRIPT, tmp_path / "benchmarks" / "gpu_check.py")
    done = subprocess.run(["make", "-s", "gpu-check"], cwd=tmp_path, capture_output=True, text=True, env=_without_nvidia_smi())
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "gpu-check: no CUDA GPU on this machine" in done.stderr
    assert not (tmp_path / ".venv-gpu").exists()


def test_the_backend_comparison_on_a_stand_in_for_vllm(tmp_path, fake_vllm):  # noqa: F811
    make_st_model(max_rationale_tokens=6).save(str(tmp_path))
    model = SentenceTransformer(str(tmp_path), trust_remote_code=True, device="cpu")
    _FakeLLM.model = model[0].model  # greedy with the same weights: the rationales agree
    report = load_benchmark("gpu_check").compare_backends(model, CORPUS[:6], batch_size=4, dtype="float32")
    assert report["passed"] and report["texts_within_tolerance"] == 6
    assert report["max_one_minus_cosine"] < 1e-5
    assert report["hf_texts_per_s"] > 0 and report["vllm_texts_per_s"] > 0
    assert model[0]._vllm is None  # switched back to the HF backend
