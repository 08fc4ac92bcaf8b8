"""The dev scoreboard (benchmarks/scoreboard.py, run by benchmarks/dev_eval.py) holds back exactly the SciFact claims training leaves out (no data folder needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_benchmark

from grace_st.data import id_fraction
from grace_training.data.examples import load_beir


scoreboard = load_benchmark("scoreboard")


@pytest.fixture(scope="module")
def dev_eval():
    return load_benchmark("dev_eval")


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


def _part(tasks: dict[str, float], seconds: float, sizes: dict | None = None) -> dict:
    """A dev_eval report of one GRACE row scored on ``tasks`` alone."""
    row = {
        "label": "run 68", "model": "runs/x/checkpoint-68", "rationale_tokens": {"query": 32, "document": 0},
        "method": "grace", "weights": None, "scores": tasks, "texts_encoded": 100, "encode_seconds": seconds / 2,
        "texts_per_s": 200 / seconds, "seconds": seconds, "examples": [{"text": "t", "rationale": "r"}],
    }
    return {"data": "/d", "seed": 1, "sizes": sizes or {"sts": 300}, "scifact": {"corpus": 1000}, "device": "cpu",
            "tasks": list(tasks), "rows": [row]}


def test_merged_parts_make_one_row_with_every_task_its_mean_and_each_part_s_time(dev_eval):
    merged = dev_eval.merge_reports({
        "a.json": _part({"SciFact": 0.6}, 2000.0),
        "b.json": _part({"STS-B dev": 0.8, "SICK-R trial": 0.7, "Banking77": 0.65, "MRPC val": 0.85,
                         "perplexity": 210.0}, 1300.0),
    })
    assert merged["merged_from"] == ["a.json", "b.json"]
    assert merged["tasks"] == ["STS-B dev", "SICK-R trial", "SciFact", "Banking77", "MRPC val", "perplexity"]
    (row,) = merged["rows"]
    assert list(row["scores"]) == merged["tasks"]  # the scoreboard's order, not the parts'
    assert row["seconds"] == 3300.0 and row["seconds_by_tasks"] == {
        "SciFact": 2000.0, "STS-B dev, SICK-R trial, Banking77, MRPC val, perplexity": 1300.0}
    assert row["texts_encoded"] == 200 and row["texts_per_s"] == pytest.approx(200 / 1650.0)
    line = dev_eval.table([row]).splitlines()[-1]
    assert f"| {sum([0.8, 0.7, 0.6, 0.65, 0.85]) / 5:.4f} | 210.00 |" in line  # a full row has its mean again


def test_merge_refuses_parts_that_are_not_one_scoreboard_or_score_a_task_twice(dev_eval):
    with pytest.raises(SystemExit, match="another 'sizes'"):
        dev_eval.merge_reports({"a.json": _part({"SciFact": 0.6}, 1.0),
                                "b.json": _part({"Banking77": 0.6}, 1.0, sizes={"sts": 500})})
    with pytest.raises(SystemExit, match="SciFact in two reports"):
        dev_eval.merge_reports({"a.json": _part({"SciFact": 0.6}, 1.0), "b.json": _part({"SciFact": 0.61}, 1.0)})


def test_distinct_words_sees_a_rationale_that_repeats_its_topic(dev_eval):
    assert dev_eval.distinct_words("A group of men, wearing a race race race race.") == pytest.approx(6 / 10)
    assert dev_eval.distinct_words("Consumers argue that changes harm choice.") == 1.0
    assert dev_eval.distinct_words(" ... ") is None  # nothing written: not a share of 1 or 0


def test_every_weights_form_is_recorded_as_json(dev_eval):
    """--weights bfloat16 loads with a torch dtype; the row records it as text (a dtype object once
    failed the report's write after a whole scoreboard)."""
    records = {name: dev_eval.weights_record(kwargs) for name, kwargs in dev_eval.weight_forms().items()}
    assert json.loads(json.dumps(records)) == {
        "float32": None, "bfloat16": {"dtype": "torch.bfloat16"}, "int8": {"weight_quantization": "int8"}
    }
