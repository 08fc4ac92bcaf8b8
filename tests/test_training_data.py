"""Data loaders (triplets, BEIR, scored pairs, MRPC, labelled, raw text), bad rows, mining, config."""

from __future__ import annotations

import json

import pytest

from grace_training.config.train_config import TrainConfig, parse_overrides
from grace_training.data.examples import load_data, load_source
from grace_training.data.mining import BM25, mine_negatives


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_triplets_jsonl_bad_rows_are_reported_and_skipped(tmp_path):
    file = write(
        tmp_path / "t.jsonl",
        "\n".join(
            [
                json.dumps({"query": "q1", "positive": "p1", "negatives": ["n1", "n2"]}),
                "{not json",
                json.dumps({"query": "", "positive": "p"}),
                json.dumps({"query": "q4", "positive": "p4", "negative": "n4"}),
                json.dumps({"query": "q5", "positive": "p5", "negatives": [3]}),
                "[1, 2]",
            ]
        ),
    )
    rows, issues = load_data([{"type": "triplets", "path": str(file)}], num_negatives=2)
    assert [(r.query, r.negatives) for r in rows] == [("q1", ("n1", "n2")), ("q4", ("n4",))]
    assert [issue.split(": ")[0] for issue in issues] == [f"{file}:2", f"{file}:3", f"{file}:5", f"{file}:6"]
    assert "invalid JSON" in issues[0] and "query" in issues[1]


def test_bad_rows_error_refuses_before_training(tmp_path):
    file = write(tmp_path / "t.jsonl", '{"query": "q", "positive": "p"}\n{broken\n')
    with pytest.raises(ValueError, match=r"t\.jsonl:2: invalid JSON"):
        load_data([{"type": "triplets", "path": str(file)}], bad_rows="error")


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="data_dir"):
        load_data([{"type": "pairs", "path": "stsb/train.tsv"}], data_dir=str(tmp_path))


def make_beir(root):
    docs = [
        ("d1", "Aspirin", "Aspirin lowers the risk of heart attack in adults."),
        ("d2", "Statins", "Statins lower cholesterol and the risk of heart attack."),
        ("d3", "Ice", "Water ice was found in craters near the lunar south pole."),
        ("d4", "Guitars", "A guitar has six strings and a hollow body."),
    ]
    write(root / "corpus.jsonl", "\n".join(json.dumps({"_id": i, "title": t, "text": x}) for i, t, x in docs))
    write(
        root / "queries.jsonl",
        "\n".join(
            [
                json.dumps({"_id": "q1", "text": "Aspirin reduces heart attack risk."}),
                json.dumps({"_id": "q2", "text": "Ice exists near the lunar pole."}),
                json.dumps({"_id": "q3"}),
            ]
        ),
    )
    write(root / "qrels" / "train.tsv", "query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td3\t1\nq2\tzzz\t1\nq1\td2\tx\n")


def test_beir_folder_gives_qrel_positives_and_bm25_negatives(tmp_path):
    make_beir(tmp_path / "mini")
    issues = []
    rows = load_source({"type": "beir", "path": "mini"}, issues, data_dir=str(tmp_path), num_negatives=1)
    by_query = {r.query: r for r in rows}
    aspirin = by_query["Aspirin reduces heart attack risk."]
    assert aspirin.positive.startswith("Aspirin") and aspirin.negatives[0].startswith(
        "Statins"
    )  # the lexical hard negative
    assert by_query["Ice exists near the lunar pole."].positive.startswith("Ice")
    assert len(issues) == 3  # query without text, unknown corpus id, non-numeric score
    # disjoint held-out slices of one split
    low = load_source({"type": "beir", "path": "mini", "query_fraction": [0, 0.5]}, [], data_dir=str(tmp_path))
    high = load_source({"type": "beir", "path": "mini", "query_fraction": [0.5, 1]}, [], data_dir=str(tmp_path))
    assert len(low) + len(high) == 2 and not {r.query for r in low} & {r.query for r in high}


def test_scored_pairs_threshold_and_negatives(tmp_path):
    file = write(
        tmp_path / "stsb" / "train.tsv",
        "score\tsentence1\tsentence2\n"
        "4.5\tA man plays a guitar.\tA man is playing the guitar.\n"
        "4.0\tA cat sleeps on a mat.\tA cat is sleeping on the mat.\n"
        "1.0\tA man plays a guitar.\tA man plays a flute loudly.\n"
        "oops\ta\tb\n"
        "2.0\tonly two fields\n",
    )
    issues = []
    rows = load_source({"type": "pairs", "path": str(file), "threshold": 4.0, "negative_threshold": 1.5}, issues)
    assert [r.positive for r in rows] == ["A man is playing the guitar.", "A cat is sleeping on the mat."]
    assert rows[0].negatives == ("A man plays a flute loudly.",)  # the low-scored partner first
    assert rows[1].negatives and rows[1].negatives[0] not in ("A cat sleeps on a mat.", "A cat is sleeping on the mat.")
    assert sorted(i.split(": ")[0] for i in issues) == [f"{file}:5", f"{file}:6"]
    assert rows[0].source == "stsb/train"


def test_mrpc_paraphrases_with_non_paraphrase_negatives(tmp_path):
    file = write(
        tmp_path / "mrpc.tsv",
        "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
        "1\t1\t2\tThe bank raised rates.\tRates were raised by the bank.\n"
        "0\t3\t4\tThe bank raised rates.\tThe bank cut its staff.\n"
        "1\t5\t6\tThe team won the cup.\tThe cup went to the team.\n"
        "7\t8\t9\tbad\tquality\n",
    )
    issues = []
    rows = load_source({"type": "mrpc", "path": str(file)}, issues)
    assert (rows[0].query, rows[0].negatives[0]) == ("The bank raised rates.", "The bank cut its staff.")
    assert len(rows) == 2 and len(issues) == 1


def test_labelled_and_raw_text_and_sts(tmp_path):
    csv = write(
        tmp_path / "b.csv",
        "text,category\nmy card is lost,lost_card\nI lost my card,lost_card\n"
        "where is my refund,refund\nrefund not arrived,refund\n,refund\n",
    )
    issues = []
    rows = load_source({"type": "labelled", "path": str(csv)}, issues)
    assert len(rows) == 4 and len(issues) == 1
    for row in rows:
        assert ("card" in row.query) == ("card" in row.positive)
        assert ("card" in row.query) != ("card" in row.negatives[0])
    text = write(tmp_path / "x.txt", "first sentence\n\nsecond sentence\n")
    raw, _ = load_data([{"type": "text", "path": str(text)}], objective="unsupervised")
    assert [(r.query, r.positive, r.negatives) for r in raw] == [
        ("first sentence", "first sentence", ()),
        ("second sentence", "second sentence", ()),
    ]
    sts = write(tmp_path / "dev.tsv", "score\tsentence1\tsentence2\n3.2\ta b\tc d\n")
    assert load_source({"type": "sts", "path": str(sts)}, [])[0].score == 3.2


def test_bm25_and_mining_never_return_positives():
    docs = ["heart attack aspirin", "heart attack statins", "lunar ice craters", "guitar strings"]
    scores = BM25(docs).scores(["aspirin heart attack"])[0]
    assert scores.argmax() == 0 and scores[3] == 0
    mined = mine_negatives(["aspirin heart attack"], docs, [{0}], 2)
    assert mined == [[1, 2]] or mined[0][0] == 1
    assert 0 not in mine_negatives(["aspirin heart attack"], docs, [{0}], 3, miner="random", seed=1)[0]
    by_model = mine_negatives(["q"], docs, [{0}], 1, miner=lambda qs, pool: [[0.9, 0.1, 0.8, 0.2]])
    assert by_model == [[2]]


def test_config_yaml_overrides_and_validation(tmp_path):
    file = write(
        tmp_path / "c.yaml", "learning_rate: 1e-6\nnum_rollouts: 4\ntrain_data:\n  - {type: text, path: x.txt}\n"
    )
    config = TrainConfig.from_yaml(file, ["batch_size=8", "report_to=[jsonl]", "tau=0.1"])
    assert config.learning_rate == 1e-6 and isinstance(config.learning_rate, float)
    assert (config.num_rollouts, config.batch_size, config.report_to, config.tau) == (4, 8, ["jsonl"], 0.1)
    defaults = TrainConfig()
    assert (
        defaults.num_rollouts,
        defaults.batch_size,
        defaults.lambda_consistency,
        defaults.lambda_hard_negative,
        defaults.tau,
        defaults.gamma,
        defaults.learning_rate,
        defaults.max_input_tokens,
        defaults.max_rationale_tokens,
        defaults.epochs,
    ) == (8, 64, 0.2, 0.2, 10.0, 1.0, 1e-6, 1024, 2048, 2)
    with pytest.raises(ValueError, match="unknown config key"):
        TrainConfig.from_yaml(file, ["lerning_rate=1"])
    with pytest.raises(ValueError, match="reward_mode"):
        TrainConfig(reward_mode="nope")
    with pytest.raises(ValueError, match="temperature_positive"):
        TrainConfig(temperature_positive=0.0)
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides(["novalue"])
