"""Offline mteb evaluation: local task files end to end on a tiny GRACE model, and the eval CLI."""

import json
import math
import os
import pickle
import tempfile

import pytest
from conftest import make_st_model

# mteb creates its default result cache folder on import; keep it out of the home directory.
os.environ.setdefault("MTEB_CACHE", os.path.join(tempfile.gettempdir(), "grace_st_test_mteb"))

mteb = pytest.importorskip("mteb")

from grace_st.cli import main
from grace_st.evaluation import (
    DataFileError,
    classification_task,
    pair_classification_task,
    retrieval_task,
    sts_task,
)

STS_ROWS = [
    (4.8, "A cat sat on the mat.", "A cat is sitting on the mat."),
    (1.2, "A cat sat on the mat.", "Stock markets fell sharply."),
    (4.1, "The fox jumps over the dog.", "A quick fox leaps over a lazy dog."),
    (1.0, "Proteins fold into shapes.", "The river bank is green."),
    (3.9, "Stock markets fell.", "The stock market dropped again."),
    (2.5, "The garden is quiet.", "The cat looked at the garden."),
    (1.5, "Rates rose again.", "The dog sat near the river."),
    (3.0, "Beta blockers reduce heart rate.", "Drugs lower blood pressure."),
]
PAIR_ROWS = [(1 if score > 3 else 0, a, b) for score, a, b in STS_ROWS]
CLASS_ROWS = [
    ("The cat sat on the mat.", "animals"),
    ("A dog barked at the fox.", "animals"),
    ("The fox ran to the river.", "animals"),
    ("Birds sat in the garden.", "animals"),
    ("A cat looked at the dog.", "animals"),
    ("Stocks fell sharply.", "finance"),
    ("Rates rose again.", "finance"),
    ("The bank raised rates, again.", "finance"),
    ("Markets dropped today.", "finance"),
    ("Interest rates are high.", "finance"),
]


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def sts_file(tmp_path, name="sick/trial.tsv"):
    # SICK's layout: scores 1-5 and an extra column.
    lines = ["score\tsentence1\tsentence2\tentailment"] + [f"{s:.1f}\t{a}\t{b}\tNEUTRAL" for s, a, b in STS_ROWS]
    return write(tmp_path / name, "\n".join(lines) + "\n")


def pairs_file(tmp_path, mrpc=False):
    if mrpc:
        lines = ["Quality\t#1 ID\t#2 ID\t#1 String\t#2 String"]
        lines += [f"{label}\t{10 + i}\t{20 + i}\t{a}\t{b}" for i, (label, a, b) in enumerate(PAIR_ROWS)]
        return write(tmp_path / "mrpc" / "val.tsv", "\n".join(lines) + "\n")
    lines = ["label\tsentence1\tsentence2"] + [f"{label}\t{a}\t{b}" for label, a, b in PAIR_ROWS]
    return write(tmp_path / "pairs" / "dev.tsv", "\n".join(lines) + "\n")


def classification_file(tmp_path, label_column="category"):
    lines = [f"text,{label_column}"] + [f'"{text}",{label}' for text, label in CLASS_ROWS]
    return write(tmp_path / "banking" / "train.csv", "\n".join(lines) + "\n")


def beir_dir(tmp_path, split="train"):
    root = tmp_path / "scifact"
    docs = [
        ("d1", "Cats", "The cat sat on the mat."),
        ("d2", "Markets", "Stock markets fell after rates rose."),
        ("d3", "", "Proteins fold into shapes in the cell."),
        ("d4", "Foxes", "A quick brown fox jumps over the lazy dog."),
        ("d5", "Rivers", "The river bank is near the garden."),
        ("d6", "Drugs", "Beta blockers reduce heart rate."),
    ]
    write(root / "corpus.jsonl", "".join(json.dumps({"_id": i, "title": t, "text": x}) + "\n" for i, t, x in docs))
    queries = [("q1", "where did the cat sit?"), ("q2", "why did markets fall?"), ("q3", "how do proteins fold?")]
    queries += [("q4", "which drugs lower blood pressure?"), ("q5", "a query nobody judged")]
    write(root / "queries.jsonl", "".join(json.dumps({"_id": i, "text": x}) + "\n" for i, x in queries))
    qrels = "query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td2\t1\nq3\td3\t1\nq4\td6\t1\nq4\td2\t0\n"
    write(root / "qrels" / f"{split}.tsv", qrels)
    return root


@pytest.fixture(scope="module")
def model():
    return make_st_model(max_rationale_tokens=2)


def run(model, task):
    result = mteb.evaluate(
        model, task, cache=None, encode_kwargs={"batch_size": 8}, show_progress_bar=False, co2_tracker=False
    )
    assert not result.exceptions
    (task_result,) = result.task_results
    return task_result


def scores_of(task_result, split="test"):
    (scores,) = task_result.scores[split]
    return scores


# -- each local task type through mteb.evaluate ------------------------------------------------


def test_sts_task_end_to_end(model, tmp_path):
    task = sts_task(sts_file(tmp_path))
    assert task.metadata.name == "sick-trial" and task.metadata.type == "STS"
    scores = scores_of(run(model, task))
    assert scores["main_score"] == scores["cosine_spearman"] and -1 <= scores["main_score"] <= 1
    # normalised with the file's own range (1.0-5.0 here), not mteb's 0-5 default
    assert (task.min_score, task.max_score) == (1.0, 4.8)


def test_sts_limit_is_a_deterministic_subsample(tmp_path):
    path = sts_file(tmp_path)
    first, second = sts_task(path, limit=5), sts_task(path, limit=5)
    first.load_data()
    second.load_data()
    rows = first.dataset["test"]["sentence2"]
    assert len(rows) == 5 and rows == second.dataset["test"]["sentence2"]
    assert first.metadata.revision != sts_task(path).metadata.revision  # limit is part of the revision


def test_retrieval_task_end_to_end(model, tmp_path):
    task = retrieval_task(beir_dir(tmp_path))  # the folder only has qrels/train.tsv
    assert task.metadata.eval_splits == ["train"] and task.metadata.name == "scifact"
    task.load_data()
    data = task.dataset["default"]["train"]
    assert data["queries"]["id"] == ["q1", "q2", "q3", "q4"]  # q5 has no qrels
    assert data["corpus"]["title"][2] == "" and len(data["corpus"]) == 6
    scores = scores_of(run(model, task), "train")
    assert scores["main_score"] == scores["ndcg_at_10"] and 0 <= scores["main_score"] <= 1


def test_retrieval_limit_keeps_relevant_documents(tmp_path):
    task = retrieval_task(beir_dir(tmp_path), split="train", limit=2, corpus_limit=3)
    task.load_data()
    data = task.dataset["default"]["train"]
    queries, corpus = data["queries"]["id"], set(data["corpus"]["id"])
    assert len(queries) == 2 and set(data["relevant_docs"]) == set(queries)
    assert {doc for q in queries for doc in data["relevant_docs"][q]} <= corpus
    assert len(corpus) == max(3, sum(len(data["relevant_docs"][q]) for q in queries))


def test_classification_task_end_to_end(model, tmp_path):
    task = classification_task(classification_file(tmp_path), n_experiments=2)
    task.load_data()
    train, test = task.dataset["train"], task.dataset["test"]
    assert task.label_names == ["animals", "finance"]
    # a deterministic stratified split: one of each label's five rows is held out
    assert sorted(test["label"]) == [0, 1] and len(train) == 8
    again = classification_task(classification_file(tmp_path), n_experiments=2)
    again.load_data()
    assert again.dataset["test"]["text"] == test["text"]
    scores = scores_of(run(model, task))
    assert scores["main_score"] == scores["accuracy"] and len(scores["scores_per_experiment"]) == 2


def test_classification_accepts_label_column_and_limit(tmp_path):
    task = classification_task(classification_file(tmp_path, "label"), limit=4)
    task.load_data()
    assert len(task.dataset["test"]) == 2  # only 2 held out, under the limit
    assert sorted(task.dataset["train"]["label"]) == [0, 0, 1, 1]  # round-robin over labels


def test_classification_reads_semicolon_text_files(tmp_path):
    # CARER emotion's layout: `text;label_name` in a .txt file
    lines = ["text;label_name"] + [f"{text.replace(',', '')};{label}" for text, label in CLASS_ROWS]
    task = classification_task(write(tmp_path / "emotion" / "val.txt", "\n".join(lines) + "\n"))
    task.load_data()
    assert task.metadata.name == "emotion-val" and len(task.dataset["train"]) + len(task.dataset["test"]) == 10


@pytest.mark.parametrize("mrpc", [False, True])
def test_pair_classification_end_to_end(model, tmp_path, mrpc):
    task = pair_classification_task(pairs_file(tmp_path, mrpc=mrpc))
    task.load_data()
    assert task.dataset["test"]["labels"] == [label for label, _, _ in PAIR_ROWS]
    scores = scores_of(run(model, task))
    assert scores["main_score"] == scores["max_ap"] and 0 <= scores["main_score"] <= 1


# -- malformed files name the file and the line ---------------------------------------------------

SCIFACT_CORPUS = '{"_id": "d1", "text": "a"}\n{"_id": "d2", "text": "b"}\n'
SCIFACT_QUERIES = '{"_id": "q1", "text": "x"}\n{"_id": "q2", "text": "y"}\n'
GOOD_QRELS = "query-id\tcorpus-id\tscore\nq1\td1\t1\n"

MALFORMED = {
    "sts missing column": ("sts", {"a.tsv": "sentence1\tsentence2\nx\ty\n"}, "a.tsv", 1, "missing score column"),
    "sts bad score": ("sts", {"a.tsv": "score\tsentence1\tsentence2\n1\tx\ty\nhigh\tx\ty\n"}, "a.tsv", 3, "'high'"),
    "sts field count": ("sts", {"a.tsv": "score\tsentence1\tsentence2\n1\tx\ty\n\n2\tx\n"}, "a.tsv", 4, "found 2"),
    "pairs bad label": (
        "pairs",
        {"p.tsv": "label\tsentence1\tsentence2\n0\ta\tb\n1\ta\tb\n2\ta\tb\n"},
        "p.tsv",
        4,
        "'2'",
    ),
    "pairs missing column": ("pairs", {"p.tsv": "label\tsentence1\n0\ta\n"}, "p.tsv", 1, "sentence2"),
    "classification missing column": ("classification", {"c.csv": "sentence,label\na,b\n"}, "c.csv", 1, "text"),
    # a quoted field spanning lines 2-3: the empty label is reported on line 4
    "classification empty label": ("classification", {"c.csv": 'text,label\n"a\nb",x\nc,\n'}, "c.csv", 4, "empty"),
    "beir bad json": (
        "beir",
        {"corpus.jsonl": '{"_id": "d1", "text": "a"}\n{"_id": "d2", "text": \n', "queries.jsonl": SCIFACT_QUERIES},
        "corpus.jsonl",
        2,
        "malformed JSON",
    ),
    "beir missing key": (
        "beir",
        {"corpus.jsonl": SCIFACT_CORPUS, "queries.jsonl": '{"_id": "q1", "text": "x"}\n\n{"_id": "q2"}\n'},
        "queries.jsonl",
        3,
        "'text'",
    ),
    "beir unknown query": (
        "beir",
        {"qrels/test.tsv": GOOD_QRELS + "q9\td1\t1\n"},
        "qrels/test.tsv",
        3,
        "query-id 'q9'",
    ),
    "beir unknown document": (
        "beir",
        {"qrels/test.tsv": "query-id\tcorpus-id\tscore\nq1\td7\t1\n"},
        "qrels/test.tsv",
        2,
        "corpus-id 'd7'",
    ),
    "beir bad qrels score": ("beir", {"qrels/test.tsv": GOOD_QRELS + "q2\td2\tyes\n"}, "qrels/test.tsv", 3, "'yes'"),
}


def make_task(kind, tmp_path, files):
    if kind == "beir":
        files = {
            "corpus.jsonl": SCIFACT_CORPUS,
            "queries.jsonl": SCIFACT_QUERIES,
            "qrels/test.tsv": GOOD_QRELS,
            **files,
        }
    for name, text in files.items():
        write(tmp_path / "data" / name, text)
    factory = {
        "sts": sts_task,
        "pairs": pair_classification_task,
        "classification": classification_task,
        "beir": retrieval_task,
    }[kind]
    target = tmp_path / "data" if kind == "beir" else tmp_path / "data" / next(iter(files))
    return factory(target)


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_files_name_file_and_line(tmp_path, case):
    kind, files, bad_file, line, detail = MALFORMED[case]
    task = make_task(kind, tmp_path, files)
    with pytest.raises(ValueError) as raised:
        task.load_data()
    assert isinstance(raised.value, DataFileError)
    message = str(raised.value)
    assert message.startswith(f"{tmp_path / 'data' / bad_file}, line {line}: "), message
    assert detail in message and raised.value.line == line


# -- the eval command --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("grace") / "model")
    make_st_model(max_rationale_tokens=2).save(path)
    return path


def test_eval_cli_table_and_json(saved_model, tmp_path, capsys, monkeypatch):
    # Registered tasks need the Hub: offline, STS12 must fail fast and the local results stay.
    # Empty caches make sure no earlier download lets it run for real.
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf_hub"))
    output = tmp_path / "results.json"
    argv = ["eval", saved_model, "--sts", str(sts_file(tmp_path)), "--beir", str(beir_dir(tmp_path))]
    argv += ["--classification", str(classification_file(tmp_path)), "--pairs", str(pairs_file(tmp_path, mrpc=True))]
    argv += ["--tasks", "STS12", "--limit", "6", "--batch-size", "8", "--output", str(output)]
    argv += ["--cache-dir", str(tmp_path / "cache"), "--no-progress", "--max-rationale-tokens", "1"]
    assert main(argv) == 1  # one task failed

    out = capsys.readouterr().out
    table = out.splitlines()
    assert table[1].split() == ["task", "type", "main", "metric", "score"]
    rows = {line.split()[0]: line.split() for line in table[3:8]}
    assert rows["sick-trial"][1:3] == ["STS", "cosine_spearman"]
    assert rows["scifact"][1:3] == ["Retrieval", "ndcg_at_10"]
    assert rows["banking-train"][1:3] == ["Classification", "accuracy"]
    assert rows["mrpc-val"][1:3] == ["PairClassification", "max_ap"]
    assert rows["STS12"][-1] == "failed" and "failed: STS12: ConnectionError" in out

    report = json.loads(output.read_text())
    # the name and revision mteb itself derives from the loaded model
    from mteb.models import SentenceTransformerEncoderWrapper
    from sentence_transformers import SentenceTransformer

    loaded = SentenceTransformer(saved_model, trust_remote_code=True)
    loaded[0].max_rationale_tokens = 1  # as --max-rationale-tokens 1 did
    loaded[0].describe_for_mteb(loaded)  # a revision that follows the settings
    meta = SentenceTransformerEncoderWrapper(loaded).mteb_model_meta
    assert (report["model"]["name"], report["model"]["revision"]) == (meta.name, meta.revision)
    # results are filed under the directory's name and the weights' revision, not "no_model_name"
    assert meta.name == f"local/{os.path.basename(saved_model)}"
    assert meta.revision.startswith(loaded[0].weights_revision + "-")
    assert report["model"]["path"] == saved_model and f"model: {meta.name} (revision {meta.revision})" == table[0]
    assert report["encoder"]["max_rationale_tokens"] == 1
    by_name = {entry["name"]: entry for entry in report["tasks"]}
    assert list(by_name) == ["sick-trial", "scifact", "banking-train", "mrpc-val", "STS12"]
    for name in ["sick-trial", "scifact", "banking-train", "mrpc-val"]:
        entry = by_name[name]
        assert entry["error"] is None and math.isfinite(entry["main_score"])
        split = "train" if name == "scifact" else "test"
        assert entry["scores"][split]["default"][entry["main_metric"]] == entry["main_score"]
    assert "ndcg_at_1" in by_name["scifact"]["scores"]["train"]["default"]
    assert by_name["STS12"]["main_score"] is None and "ConnectionError" in by_name["STS12"]["error"]


def test_eval_cli_reruns_a_changed_model(saved_model, tmp_path, capsys):
    # Same model name and revision in mteb's cache, different settings: must not be skipped.
    sts = str(sts_file(tmp_path))
    pearson = []
    for tokens in ("0", "2"):
        output = tmp_path / f"{tokens}.json"
        argv = ["eval", saved_model, "--sts", sts, "--cache-dir", str(tmp_path / "cache"), "--no-progress"]
        assert main([*argv, "--max-rationale-tokens", tokens, "--output", str(output)]) == 0
        pearson.append(json.loads(output.read_text())["tasks"][0]["scores"]["test"]["default"]["cosine_pearson"])
    assert pearson[0] != pearson[1]
    assert "sick-trial" in capsys.readouterr().out


def test_eval_cli_malformed_file_names_file_and_line(saved_model, tmp_path):
    bad = write(tmp_path / "bad.tsv", "score\tsentence1\tsentence2\n1\ta\tb\nn/a\tc\td\n")
    with pytest.raises(SystemExit) as raised:
        main(["eval", saved_model, "--sts", str(bad), "--cache-dir", str(tmp_path / "cache")])
    assert str(raised.value) == f"grace-st eval: {bad}, line 3: score 'n/a' is not a number"


# -- instructions: a task's own, else the prompt type's --------------------------------------------


def test_a_task_s_own_instruction_is_used_and_a_task_without_one_gets_the_prompt_type_s(tmp_path, monkeypatch):
    """model.prompts keyed by a task's name (or ``<name>-query``) give that task its own instruction, used in place
    of the prompt type's, local tasks included (mteb alone drops prompts keyed by names outside its registry);
    a task without one gets the GenerativeEncoder's instruction for the prompt type."""
    from grace_st.evaluation import mteb_wrapper, run_evaluation
    from grace_st.prompts import DEFAULT_INSTRUCTIONS

    model = make_st_model(max_rationale_tokens=0)
    encoder = model[0]
    tasks = {
        "with-instruction": sts_task(sts_file(tmp_path, "a/one.tsv"), name="with-instruction"),
        "without-instruction": sts_task(sts_file(tmp_path, "b/two.tsv"), name="without-instruction"),
        "claims": retrieval_task(beir_dir(tmp_path), name="claims"),
    }
    own = {"with-instruction": "Retrieve sentences that mean the same.", "claims-query": "Given a claim, find its proof."}
    model.prompts.update(own)
    prompts = dict(model.prompts)
    used, template = set(), encoder.prompt_template

    def spy(instruction):
        used.add(instruction)
        return template(instruction)

    monkeypatch.setattr(encoder, "prompt_template", spy)
    expected = {
        "with-instruction": {own["with-instruction"]},
        "without-instruction": {DEFAULT_INSTRUCTIONS["default"]},
        "claims": {own["claims-query"], DEFAULT_INSTRUCTIONS["document"]},
    }
    for name, task in tasks.items():
        used.clear()
        report = run_evaluation(model, [task], cache_dir=tmp_path / "cache", show_progress_bar=False)
        assert report["tasks"][0]["error"] is None
        assert used == expected[name], name
    assert model.prompts == prompts and list(model.prompts) == list(prompts)  # as they were, in order
    assert mteb_wrapper(model, [tasks["claims"]]).model_prompts["claims-query"] == own["claims-query"]
    # mteb's own wrapper drops the local task's prompt: its instruction would not be used
    used.clear()
    run(model, tasks["with-instruction"])
    assert used == {DEFAULT_INSTRUCTIONS["default"]}


def test_a_task_instruction_replaces_the_prompt_type_s_and_any_other_prompt_joins_it():
    model = make_st_model(max_rationale_tokens={"default": 0, "query": 2, "document": 0})
    encoder = model[0]
    model.prompts["STSBenchmark"] = "Retrieve semantically similar text."
    model.prompts["SciFact-query"] = "Given a scientific claim, retrieve documents that support it."
    assert encoder.instruction_for(None, "Retrieve semantically similar text.") == "Retrieve semantically similar text."
    query = "Given a scientific claim, retrieve documents that support it."
    assert encoder.instruction_for("query", query) == query
    assert encoder.prompt_type("query", query) == "query"  # the call's prompt type still picks the budget
    assert int(model.encode_query(["a claim"], prompt=query, output_value=None)[0]["rationale_budget"]) == 2
    assert encoder.instruction_for(None, "Be brief.") == f"{encoder.instructions['default']}\nBe brief."
    model.prompts["query"] = "Answer the query."  # a prompt type's prompt (LlamaIndex's query_instruction) joins
    assert encoder.instruction_for("query", "Answer the query.").endswith("\nAnswer the query.")
    copied = pickle.loads(pickle.dumps(model))  # a copy still knows its own prompts
    assert copied[0].instruction_for(None, "Retrieve semantically similar text.") == "Retrieve semantically similar text."
