"""The data mix: gzip JSON-lines sources, symmetric sources, per-source weights, batches by source."""

from __future__ import annotations

import collections
import gzip
import json
import random

import pytest

from grace_training.data.examples import Triplet, load_data, source_weights
from grace_training.data.sampling import BatchSchedule


def _gzip_jsonl(path, rows):
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def test_twitter_style_labelled_pairs_and_wikiqa_style_triplets_read_from_gzip(tmp_path):
    pairs = _gzip_jsonl(
        tmp_path / "pairs.jsonl.gz",
        [
            {"sentence1": "obama visits kenya", "sentence2": "president obama lands in kenya", "label": 1},
            {"sentence1": "obama visits kenya", "sentence2": "kenya wins a marathon", "label": 0},
            {"sentence1": "new phone released", "sentence2": "apple releases a phone", "label": 1},
            {"sentence1": "bad", "sentence2": "row", "label": 2},
        ],
    )
    triplets = _gzip_jsonl(
        tmp_path / "wiki.jsonl.gz",
        [
            {"query": "how are caves formed ?", "positive": "a cave forms in ice .", "negatives": ["ice is cold ."]},
        ],
    )
    rows, issues = load_data(
        [{"type": "mrpc", "path": str(pairs), "symmetric": True}, {"type": "triplets", "path": str(triplets)}],
        seed=0,
    )
    twitter = [r for r in rows if r.source == f"{tmp_path.name}/pairs"]
    assert [(r.query, r.positive) for r in twitter] == [
        ("obama visits kenya", "president obama lands in kenya"),
        ("new phone released", "apple releases a phone"),
    ]
    assert twitter[0].negatives[0] == "kenya wins a marathon"  # the same-topic non-paraphrase first
    assert all(r.symmetric for r in twitter)
    wiki = [r for r in rows if r.source == f"{tmp_path.name}/wiki"]
    assert wiki == [Triplet("how are caves formed ?", "a cave forms in ice .", ("ice is cold .",), wiki[0].source)]
    assert len(issues) == 1 and "pairs.jsonl.gz:4: label must be 0 or 1" in issues[0]


def test_source_weights_default_to_size_and_are_checked(tmp_path):
    rows = [Triplet("q", "p", (), "a")] * 3 + [Triplet("q", "p", (), "b")]
    specs = [
        {"type": "triplets", "path": "x/a.jsonl", "name": "a"},
        {"type": "triplets", "path": "b.jsonl", "name": "b", "weight": 5},
    ]
    assert source_weights(specs, rows) == {"a": 3.0, "b": 5.0}
    with pytest.raises(ValueError, match="'weight' must be a number >= 0"):
        source_weights([{"type": "triplets", "path": "a.jsonl", "weight": -1}], rows)
    with pytest.raises(ValueError, match="'symmetric' must be true or false"):
        load_data([{"type": "triplets", "path": str(tmp_path / "a.jsonl"), "symmetric": "yes"}])


SOURCES = ["sts"] * 40 + ["scifact"] * 20 + ["twitter"] * 300


def test_shuffled_schedule_is_the_old_epoch_permutation():
    schedule = BatchSchedule(SOURCES, 8, seed=42)
    order = list(range(len(SOURCES)))
    random.Random(42).shuffle(order)
    assert schedule.batch(0) == order[:8] and schedule.batch(3) == order[24:32]
    order = list(range(len(SOURCES)))
    random.Random(43).shuffle(order)
    assert schedule.batch(len(SOURCES) // 8) == order[:8]  # the second epoch


def test_by_source_batches_hold_one_source_drawn_by_weight_and_resume_identically():
    weights = {"sts": 1.0, "scifact": 1.0, "twitter": 2.0}
    schedule = BatchSchedule(SOURCES, 8, seed=7, sampling="by_source", weights=weights)
    batches = [schedule.batch(step) for step in range(400)]
    drawn = collections.Counter()
    for batch in batches:
        assert len(batch) == 8 and len({SOURCES[i] for i in batch}) == 1
        drawn[SOURCES[batch[0]]] += 1
    assert 0.4 < drawn["twitter"] / 400 < 0.6 and drawn["sts"] > 60 and drawn["scifact"] > 60
    # a small source cycles through all of its triplets before repeating one
    scifact = [i for batch in batches if SOURCES[batch[0]] == "scifact" for i in batch]
    assert sorted(scifact[:20]) == list(range(40, 60))
    # a fresh schedule (a resumed run) asked for a late step first gives the same batch
    assert BatchSchedule(SOURCES, 8, seed=7, sampling="by_source", weights=weights).batch(321) == batches[321]
    assert BatchSchedule(SOURCES, 8, seed=8, sampling="by_source", weights=weights).batch(5) != batches[5]


def test_by_source_refuses_a_source_smaller_than_a_batch_unless_weighted_zero():
    with pytest.raises(ValueError, match=r"fewer in: scifact \(20\)"):
        BatchSchedule(SOURCES, 32, seed=0, sampling="by_source")
    schedule = BatchSchedule(SOURCES, 32, seed=0, sampling="by_source", weights={"scifact": 0, "sts": 1, "twitter": 1})
    assert {SOURCES[schedule.batch(s)[0]] for s in range(50)} == {"sts", "twitter"}


def test_a_labelled_source_can_leave_out_the_scoreboards_sample(tmp_path):
    """Banking77 trains on same-intent pairs; the texts dev_eval's kNN uses stay unseen."""
    from grace_st.data import read_labelled_texts, scoreboard_sample

    folder = tmp_path / "banking77"
    folder.mkdir()
    lines = [f"how do I do thing number {i} for my card?,intent_{i % 3}" for i in range(30)]
    (folder / "train.csv").write_text("text,category\n" + "\n".join(lines) + "\n")
    dev = {item.text for item in scoreboard_sample(read_labelled_texts(folder / "train.csv"), 10, "banking77")}
    rows, _ = load_data([{"type": "labelled", "path": str(folder / "train.csv"), "hold_out_scoreboard": 10}])
    seen = {t for r in rows for t in (r.query, r.positive, *r.negatives)}
    assert len(dev) == 10 and not dev & seen and len(seen) == 20
