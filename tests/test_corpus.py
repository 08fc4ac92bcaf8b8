"""``grace-st encode-corpus`` on a real Ray (a local one, and a two-node cluster from Ray's own test utility):
each id once, embeddings the bits of ``encode_document``, a run resumed after a killed worker or driver, bad
rows named before any model work. Tiny random models saved to a folder, loaded by the actors from the path."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import make_st_model

ray = pytest.importorskip("ray")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from grace_st.corpus import CorpusError, encode_corpus, read_output

REPO = Path(__file__).resolve().parents[1]
# A short instruction and a 64-token prompt limit: the tiny tokenizer spends ~3 tokens a word.
MODEL_SETTINGS = {
    "max_rationale_tokens": {"default": 4, "document": 6},
    "instructions": {"document": "Read the document."},
    "max_input_tokens": 64,
}
TEXTS = [f"text {i}: {word} about cats and markets" for i, word in enumerate(["red", "blue", "sun", "sea"] * 6)]
LONG_TEXT = "The cat sat on the mat. " * 5  # 84 prompt tokens with the template, over 64
KILL_PLAN = "GRACE_ST_TEST_KILL_PLAN"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "model"
    make_st_model(**MODEL_SETTINGS).save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def reference(model_dir):
    """``encode_document`` in this process, id -> float32 vector."""
    from grace_st import load

    model = load(model_dir, device="cpu")
    vectors = model.encode_document(TEXTS, convert_to_numpy=True)
    return {f"d{i}": vectors[i] for i in range(len(TEXTS))}


def _write_jsonl(path: Path, rows: list[dict] | list[bytes]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        handle.writelines((row if isinstance(row, bytes) else json.dumps(row).encode()) + b"\n" for row in rows)
    return str(path)


def _corpus(folder: Path, files: int = 3) -> str:
    """TEXTS as ``files`` JSONL files of ids d0, d1, ..."""
    per_file = -(-len(TEXTS) // files)
    for part in range(files):
        indexes = range(part * per_file, min(len(TEXTS), (part + 1) * per_file))
        rows = [{"id": f"d{i}", "text": TEXTS[i]} for i in indexes]
        _write_jsonl(folder / f"part{part}.jsonl", rows)
    return str(folder)


def _embeddings(output: str, id_column: str = "id") -> dict:
    table = pq.read_table(output)
    ids = table.column(id_column).to_pylist()
    assert len(ids) == len(set(ids)), "an id written twice"
    return dict(zip(ids, np.array(table.column("embedding").to_pylist(), dtype=np.float32)))


def _assert_bits(found: dict, reference: dict) -> None:
    assert sorted(found) == sorted(reference)
    for key, vector in reference.items():
        assert np.array_equal(found[key], vector), key  # max abs difference 0 in float32


def _kill_hook():
    """A Ray worker setup hook: the CorpusEncoder actor kills its own process after the batch that the kill plan
    file counts down to, once (the file is removed as it dies)."""
    plan = os.environ.get(KILL_PLAN)
    if not plan:
        return
    from grace_st import corpus

    original = corpus.CorpusEncoder.__call__

    def call(self, batch):
        result = original(self, batch)
        try:
            left = int(Path(plan).read_text())
        except (FileNotFoundError, ValueError):
            return result
        if left <= 1:
            os.remove(plan)
            os._exit(1)
        Path(plan).write_text(str(left - 1))
        return result

    corpus.CorpusEncoder.__call__ = call


@pytest.fixture(scope="module")
def kill_plan(tmp_path_factory):
    return tmp_path_factory.mktemp("kill") / "plan"


@pytest.fixture
def local_ray(kill_plan, monkeypatch):
    """One local Ray of 2 CPUs for the module's local tests (started on first use, shut down at the end)."""
    if not ray.is_initialized():
        monkeypatch.setenv(KILL_PLAN, str(kill_plan))  # the workers inherit it from the Ray started here
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        ray.init(
            num_cpus=2, include_dashboard=False, logging_level="WARNING",
            runtime_env={"worker_process_setup_hook": _kill_hook},
        )
    yield


@pytest.fixture(scope="module", autouse=True)
def _shutdown_ray():
    yield
    ray.shutdown()


def test_a_two_node_cluster_encodes_parquet_and_lists_skipped_rows(model_dir, reference, tmp_path):
    """Two nodes of one CPU each (ray.cluster_utils.Cluster), joined by address: one actor a node. Parquet in,
    numbered rows, bad rows skipped into the report, float16 out."""
    from ray.cluster_utils import Cluster

    ray.shutdown()
    texts = [*TEXTS[:6], "", None, LONG_TEXT]
    pq.write_table(pa.table({"body": texts}), tmp_path / "corpus.parquet")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        summary = encode_corpus(
            str(tmp_path / "corpus.parquet"), str(tmp_path / "out"), model=model_dir, text_column="body",
            make_ids=True, actors=2, threads_per_actor=1, batch_size=2, rows_per_shard=2, on_bad_row="skip",
            dtype="float16", address=cluster.address, progress=False,
        )
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert summary["encoded"] == 6 and summary["skipped"] == 3 and summary["actors"] == 2
    found = _embeddings(str(tmp_path / "out"))
    assert sorted(found) == list(range(6))
    for index in range(6):
        assert np.array_equal(found[index], reference[f"d{index}"].astype(np.float16).astype(np.float32))
    skipped = [json.loads(line) for line in Path(summary["bad_row_report"]).read_text().splitlines()]
    assert [(entry["row"], entry.get("id")) for entry in skipped] == [(7, 6), (8, 7), (9, 8)]
    assert "'body' is empty" in skipped[0]["problem"] and "'body' is null" in skipped[1]["problem"]
    assert "84 prompt tokens" in skipped[2]["problem"]


def test_a_corpus_is_the_bits_of_encode_document_and_a_rerun_loads_no_model(
    local_ray, model_dir, reference, tmp_path
):
    corpus, out = _corpus(tmp_path / "in"), str(tmp_path / "out")
    summary = encode_corpus(corpus, out, model=model_dir, actors=2, threads_per_actor=1, batch_size=3,
                            rows_per_shard=4, rationale=True, progress=False)
    assert summary["encoded"] == len(TEXTS) and summary["output_rows"] == len(TEXTS)
    _assert_bits(_embeddings(out), reference)

    from grace_st import explain, load

    table = pq.read_table(out)
    rationales = dict(zip(table.column("id").to_pylist(), table.column("rationale").to_pylist()))
    expected = explain(load(model_dir, device="cpu"), TEXTS[:3], prompt_name="document")
    assert [rationales[f"d{i}"] for i in range(3)] == [item["rationale"] for item in expected]

    metadata = json.loads(pq.read_schema(read_output(out).shards[0]).metadata[b"grace_st"])
    assert metadata["model"] == model_dir and metadata["prompt_type"] == "document"
    assert metadata["max_rationale_tokens"] == 6 and metadata["instruction"] == "Read the document."
    assert metadata["weights_revision"] and metadata["dtype"] == "float32" and metadata["rationale"] is True

    with pytest.raises(CorpusError, match=r"another model or settings .*max_rationale_tokens: 6 there, 2 now"):
        encode_corpus(corpus, out, model=model_dir, rationale=True, settings={"max_rationale_tokens": {"document": 2}})

    # No weights: a rerun that loaded the model would fail.
    weights = Path(model_dir) / "model.safetensors"
    weights.rename(weights.with_suffix(".away"))
    try:
        again = encode_corpus(corpus, out, model=model_dir, actors=2, rationale=True, progress=False)
    finally:
        weights.with_suffix(".away").rename(weights)
    assert again["encoded"] == 0 and again["already_done"] == len(TEXTS) and again["actors"] == 0


def test_a_worker_killed_mid_run_and_a_cut_shard_leave_every_id_once(
    local_ray, kill_plan, model_dir, reference, tmp_path
):
    """The actor's process dies after its second batch: Ray restarts it and retries the block. Then a shard cut
    short (a write killed half-way) is removed by the next run, which encodes its ids again, and only them."""
    corpus, out = _corpus(tmp_path / "in", files=4), str(tmp_path / "out")
    kill_plan.write_text("2")
    summary = encode_corpus(corpus, out, model=model_dir, actors=1, threads_per_actor=1, batch_size=2,
                            rows_per_shard=3, progress=False)
    assert not kill_plan.exists(), "the actor was not killed"
    assert summary["encoded"] == len(TEXTS)
    _assert_bits(_embeddings(out), reference)

    shard = read_output(out).shards[0]
    cut = set(pq.read_table(shard).column("id").to_pylist())
    data = Path(shard).read_bytes()
    Path(shard).write_bytes(data[: len(data) // 2])
    again = encode_corpus(corpus, out, model=model_dir, actors=1, threads_per_actor=1, batch_size=2, progress=False)
    assert again["incomplete_shards_removed"] == 1 and again["encoded"] == len(cut)
    assert again["already_done"] == len(TEXTS) - len(cut)
    _assert_bits(_embeddings(out), reference)


def _cli(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop(KILL_PLAN, None)
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen(
        [sys.executable, "-m", "grace_st.cli", "encode-corpus", *args], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True, **kwargs,
    )


def _group_gone(pgid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_a_driver_killed_mid_run_then_run_again_finishes_every_id_once(model_dir, reference, tmp_path):
    """The CLI (its own local Ray) killed with its whole process group once the first shard is written; the
    same command again writes only the missing ids."""
    corpus, out = _corpus(tmp_path / "in", files=6), tmp_path / "out"
    args = [corpus, str(out), "--model", model_dir, "--actors", "1", "--threads-per-actor", "1", "--batch-size",
            "1", "--rows-per-shard", "1", "--no-progress"]
    process = _cli(*args)
    try:
        deadline = time.monotonic() + 240
        while not list(out.glob("*.parquet")) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process.poll() is None, process.communicate()[0][-3000:]
        os.killpg(process.pid, signal.SIGKILL)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert _group_gone(process.pid, 30), "Ray processes of the killed run still alive"
    written = len(read_output(str(out)).ids)
    assert 0 < written < len(TEXTS), written

    rerun = _cli(*args)
    log = rerun.communicate(timeout=300)[0]
    assert rerun.returncode == 0, log[-3000:]
    assert f"{len(TEXTS) - written:,} texts" in log and f"{written:,} already done" in log, log[-2000:]
    _assert_bits(_embeddings(str(out)), reference)


# -- bad input: named with file and line before any model work (the model folder has no weights) ----------------


@pytest.fixture(scope="module")
def settings_only_model(model_dir, tmp_path_factory):
    """The model's settings and tokenizer without its weights: a check that loaded the model would fail."""
    path = tmp_path_factory.mktemp("no_weights") / "model"
    shutil.copytree(model_dir, path, ignore=shutil.ignore_patterns("*.safetensors"))
    return str(path)


GOOD = {"id": "a", "text": "a good text"}
BAD_ROWS = {
    "null text": ({"id": "b", "text": None}, "(id 'b'): 'text' is null"),
    "empty text": ({"id": "b", "text": ""}, "(id 'b'): 'text' is empty"),
    "blank text": ({"id": "b", "text": "  \t"}, "(id 'b'): 'text' is only whitespace"),
    "number text": ({"id": "b", "text": 42}, "(id 'b'): 'text' is int, not str"),
    "lone surrogate": ({"id": "b", "text": "bad \ud800 text"}, "(id 'b'): 'text' is not valid Unicode"),
    "invalid UTF-8": (b'{"id": "b", "text": "caf\xe9"}', "line 2: not valid UTF-8 (byte 0xe9"),
    "invalid JSON": (b'{"id": "b", "text": ', "line 2: not valid JSON"),
    "no id": ({"text": "an orphan"}, "line 2: no 'id' field"),
    "float id": ({"id": 1.5, "text": "x"}, "line 2: the id is float"),
    "id of another type": ({"id": 7, "text": "x"}, "(id 7): the id is an integer; earlier ids are strings"),
    "too long": ({"id": "b", "text": LONG_TEXT}, "(id 'b'): 84 prompt tokens"),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_a_bad_row_is_named_by_file_and_line_before_any_model_work(case, settings_only_model, tmp_path):
    row, message = BAD_ROWS[case]
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", [GOOD, row])
    with pytest.raises(CorpusError) as caught:
        encode_corpus(corpus, str(tmp_path / "out"), model=settings_only_model)
    assert f"{corpus} line 2" in str(caught.value) and message in str(caught.value)
    assert "nothing was encoded" in str(caught.value) and "--on-bad-row skip" in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_a_bad_parquet_text_is_named_by_row(settings_only_model, tmp_path):
    """Parquet does not check that a string column holds UTF-8: the row's bytes are named."""
    path = tmp_path / "corpus.parquet"
    texts = pa.array([b"fine", b"caf\xe9"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"id": pa.array([1, 2]), "text": texts}), path)
    with pytest.raises(CorpusError, match=rf"{path} row 2 \(id 2\): 'text' is not valid UTF-8 \(byte 0xe9"):
        encode_corpus(str(path), str(tmp_path / "out"), model=settings_only_model)


@pytest.mark.parametrize(
    ("rows", "options", "message"),
    [
        ([GOOD, {"id": "a", "text": "again"}], {}, "line 2: id 'a' again (first at {corpus} line 1)"),
        ([{"id": "a", "body": "x"}], {}, "no row has a 'text' field; name the column with --text-column"),
        ([{"key": "a", "text": "x"}], {}, "no row has a 'id' field; name the column with --id-column"),
        ([GOOD], {"missing": True}, "missing.jsonl: no such file or folder"),
    ],
    ids=["duplicate id", "no text column", "no id column", "missing file"],
)
def test_a_corpus_that_cannot_be_read_is_an_error(rows, options, message, settings_only_model, tmp_path):
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", rows)
    given = str(tmp_path / "missing.jsonl") if options.get("missing") else corpus
    with pytest.raises(CorpusError) as caught:
        encode_corpus(given, str(tmp_path / "out"), model=settings_only_model)
    assert message.format(corpus=corpus) in str(caught.value)


def test_a_parquet_file_without_the_id_column_is_an_error(settings_only_model, tmp_path):
    path = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"text": ["x"]}), path)
    with pytest.raises(CorpusError, match=r"no column 'id' \(its columns: text\); name it with --id-column"):
        encode_corpus(str(path), str(tmp_path / "out"), model=settings_only_model)


def test_an_output_folder_holding_other_parquet_files_is_refused(settings_only_model, tmp_path):
    (tmp_path / "out").mkdir()
    pq.write_table(pa.table({"id": ["x"]}), tmp_path / "out" / "theirs.parquet")
    corpus = _write_jsonl(tmp_path / "corpus.jsonl", [GOOD])
    with pytest.raises(CorpusError, match="holds Parquet files encode-corpus did not write"):
        encode_corpus(corpus, str(tmp_path / "out"), model=settings_only_model)


def test_importing_grace_st_imports_no_ray():
    code = "import sys, grace_st; grace_st.encode_corpus; print('ray' in sys.modules)"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert found.stdout.strip() == "False"
