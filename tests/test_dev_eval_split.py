"""The dev scoreboard (grace_st.scoreboard, run by benchmarks/dev_eval.py) holds back exactly the SciFact claims training leaves out (no data folder needed)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from grace_st import scoreboard
from grace_st.data import id_fraction
from grace_training.data import load_beir

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dev_eval():
    spec = importlib.util.spec_from_file_location("dev_eval", ROOT / "benchmarks" / "dev_eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def beir(tmp_path: Path) -> Path:
    """A tiny BEIR folder: 60 claims, each citing one or two of 100 abstracts."""
    (tmp_path / "qrels").mkdir()
    with open(tmp_path / "corpus.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(
            json.dumps({"_id": f"d{d}", "title": f"title {d}", "text": f"abstract number {d}"}) + "\n"
            for d in range(100)
        )
    with open(tmp_path / "queries.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps({"_id": str(q), "text": f"claim number {q}"}) + "\n" for q in range(60))
    with open(tmp_path / "qrels" / "train.tsv", "w", encoding="utf-8") as handle:
        handle.write("query-id\tcorpus-id\tscore\n")
        for q in range(60):
            handle.write(f"{q}\td{q}\t1\n")
            if q % 3 == 0:
                handle.write(f"{q}\td{q + 40}\t1\n")
    return tmp_path


def test_scifact_claims_are_the_complement_of_training(beir):
    issues: list[str] = []
    training = load_beir(
        beir, "train", issues, "scifact", num_negatives=1, miner="random", seed=0, query_fraction=(0.0, 0.9)
    )
    assert not issues
    queries, corpus, qrels = scoreboard.scifact(beir, 0, 80)
    trained = {t.query for t in training}
    held_back = set(queries.values())
    assert held_back, "the fixture should hold some claims back"
    assert not held_back & trained
    assert held_back | trained == {f"claim number {q}" for q in range(60)}
    assert set(queries) == {str(q) for q in range(60) if id_fraction(str(q)) >= 0.9}
    # every cited abstract is in the corpus, padded with distractors to the requested size
    assert {d for q in queries for d in qrels[q]} <= set(corpus)
    assert len(corpus) == 80


def test_scifact_sample_is_fixed_and_held_back(beir):
    first, _, _ = scoreboard.scifact(beir, 2, 10)
    again, _, _ = scoreboard.scifact(beir, 2, 10)
    everything, _, _ = scoreboard.scifact(beir, 0, 10)
    assert list(first) == list(again) and len(first) == min(2, len(everything))
    assert set(first) <= set(everything)


def test_parse_model(dev_eval):
    assert dev_eval.parse_model("runs/x/checkpoint-00000100@0", 64) == ("runs/x/checkpoint-00000100", 0, True)
    assert dev_eval.parse_model("runs/x/checkpoint-00000100@32", 64) == ("runs/x/checkpoint-00000100", 32, True)
    assert dev_eval.parse_model("runs/x/checkpoint-00000100", 64) == ("runs/x/checkpoint-00000100", 64, False)
    assert dev_eval.parse_model("runs/a@b/model", 64) == ("runs/a@b/model", 64, False)
    assert dev_eval.parse_model("runs/x/checkpoint-00000100@saved", 64) == ("runs/x/checkpoint-00000100", None, True)


def test_write_json_replaces_atomically(tmp_path):
    out = tmp_path / "results" / "dev_eval.json"
    scoreboard.write_json({"rows": [1]}, str(out))
    scoreboard.write_json({"rows": [1, 2]}, str(out))
    assert json.loads(out.read_text()) == {"rows": [1, 2]}
    assert [p.name for p in out.parent.iterdir()] == ["dev_eval.json"]


def test_a_row_scored_on_some_tasks_has_only_those_and_no_mean(dev_eval):
    from conftest import make_st_model

    model = make_st_model(max_rationale_tokens=2)
    first, second = ["a cat sits", "dogs run fast", "rain falls"], ["a cat is sitting", "a dog runs", "the sun"]
    tasks = {"STS-B dev": (first, second, [5.0, 3.0, 0.0])}  # the other tasks are never read
    scores, encoder = scoreboard.evaluate(model, tasks, batch_size=4, only=("STS-B dev",))
    assert list(scores) == ["STS-B dev"] and -1.0 <= scores["STS-B dev"] <= 1.0
    assert encoder.texts == 6
    row = {"label": "partial", "scores": scores, "texts_per_s": 1.0, "seconds": 1.0}
    line = dev_eval.table([row]).splitlines()[-1]
    assert line.startswith(f"| partial | {scores['STS-B dev']:.4f} | — | — | — | — | — | n/a |")
