"""The data layer (grace_st.data): one parse of each format for training, evaluation and benchmarks."""

from __future__ import annotations

import json

import pytest
from conftest import deadline

from grace_st.data import (
    DataFileError,
    read_beir,
    read_labelled_pairs,
    read_labelled_texts,
    read_scored_pairs,
    read_texts,
    read_triplets,
)
from grace_training.data.examples import load_source


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_a_bad_row_raises_without_on_error_and_is_left_out_with_it(tmp_path):
    file = write(tmp_path / "s.tsv", "score\tsentence1\tsentence2\n4.5\ta\tb\nhigh\tc\td\n1\te\n2.0\tg\th\n")
    # the table is read whole before its values are parsed: the short row is found first
    with pytest.raises(DataFileError, match=r"s\.tsv, line 4: expected 3 fields"):
        read_scored_pairs(file)
    errors: list[DataFileError] = []
    pairs = read_scored_pairs(file, on_error=errors.append)
    assert [(p.line, p.sentence1, p.score) for p in pairs] == [(2, "a", 4.5), (5, "g", 2.0)]
    assert [(e.line, e.reason.split(" (")[0]) for e in errors] == [
        (4, "expected 3 fields"),
        (3, "score 'high' is not a number"),
    ]


def test_a_missing_column_is_one_error_and_no_rows(tmp_path):
    file = write(tmp_path / "p.tsv", "label\tsentence1\n1\ta\n0\tb\n")
    errors: list[DataFileError] = []
    assert read_labelled_pairs(file, on_error=errors.append) == []
    assert len(errors) == 1 and errors[0].line == 1 and "sentence2" in errors[0].reason


def test_training_and_evaluation_read_the_same_texts(tmp_path):
    """A quoted CSV field may span lines: the one reader keeps it whole for every consumer."""
    file = write(tmp_path / "b.csv", 'text,category\n"my card\nis lost",lost_card\nI lost my card,lost_card\n')
    texts = read_labelled_texts(file)
    assert [(t.line, t.text, t.label) for t in texts] == [
        (2, "my card\nis lost", "lost_card"),
        (4, "I lost my card", "lost_card"),
    ]
    rows = load_source({"type": "labelled", "path": str(file), "num_negatives": 0}, [])
    assert {row.query for row in rows} == {t.text for t in texts}


def test_mrpc_header_and_labels(tmp_path):
    file = write(
        tmp_path / "mrpc.tsv",
        'Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\tHe said "yes.\tHe agreed.\n0\t3\t4\ta\tb\n',
    )
    pairs = read_labelled_pairs(file)
    # TSV fields are literal: an unbalanced quote is text, as MRPC and STS-B need
    assert [(p.sentence1, p.label) for p in pairs] == [('He said "yes.', 1), ("a", 0)]


def test_beir_ids_resolve_and_bad_records_are_reported(tmp_path):
    write(
        tmp_path / "corpus.jsonl",
        '{"_id": "d1", "title": "T", "text": "a"}\n{"_id": 2, "text": "b"}\n{"_id": "d1", "text": "c"}\n',
    )
    write(tmp_path / "queries.jsonl", '{"_id": "q1", "text": "x"}\n{"_id": "q2"}\n')
    write(tmp_path / "qrels" / "dev.tsv", "query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\t2\t0\nq2\td1\t1\nq1\td9\t1\n")
    errors: list[DataFileError] = []
    folder = read_beir(tmp_path, "dev", on_error=errors.append)
    assert {d: (r.title, r.text) for d, r in folder.corpus.items()} == {"d1": ("T", "a"), "2": ("", "b")}
    assert folder.qrels == {"q1": {"d1": 1, "2": 0}}
    reasons = sorted((e.path.rsplit("/", 1)[-1], e.line) for e in errors)
    assert reasons == [("corpus.jsonl", 3), ("dev.tsv", 4), ("dev.tsv", 5), ("queries.jsonl", 2)]
    with pytest.raises(DataFileError, match="duplicate _id 'd1'"):
        read_beir(tmp_path, "dev")


def test_triplets_and_texts(tmp_path):
    file = write(
        tmp_path / "t.jsonl",
        json.dumps({"query": "q", "positive": "p", "negative": "n"})
        + "\n\n"
        + json.dumps({"query": "q2", "positive": ""})
        + "\n",
    )
    errors: list[DataFileError] = []
    assert [(t.line, t.negatives) for t in read_triplets(file, errors.append)] == [(1, ("n",))]
    assert [(e.line, e.reason) for e in errors] == [(3, "missing or empty 'positive'")]
    lines = write(tmp_path / "x.txt", "one\n\n  \ntwo\n")
    assert read_texts(lines) == [(1, "one"), (4, "two")]
    table = write(tmp_path / "x.tsv", "id\tsentence\n1\tfirst\n2\t\n")
    with pytest.raises(DataFileError, match=r"x\.tsv, line 3: missing or empty 'sentence'"):
        read_texts(table, column="sentence")


# -- every reader streams under the data files' limits ---------------------------------

READERS = {
    "table": read_scored_pairs,
    "jsonl": read_triplets,
    "jsonl.gz": read_triplets,
    "text": read_texts,
}


def sample(tmp_path, kind: str, tail: bytes = b""):
    """A valid file of ``kind`` with ``tail`` appended (for .gz, inside the compressed stream)."""
    import gzip

    if kind == "table":
        return tmp_path / "s.tsv", b"score\tsentence1\tsentence2\n1\ta\tb\n" + tail
    line = b'{"query": "q", "positive": "p"}\n'
    if kind == "jsonl":
        return tmp_path / "t.jsonl", line + tail
    if kind == "jsonl.gz":
        return tmp_path / "t.jsonl.gz", gzip.compress(line + tail)
    return tmp_path / "t.txt", b"first text\n" + tail


@pytest.mark.parametrize("kind", list(READERS))
def test_a_line_over_the_limit_stops_every_reader_naming_the_line(tmp_path, monkeypatch, kind):
    from grace_st.data import files

    monkeypatch.setattr(files, "MAX_LINE_BYTES", 100)
    path, content = sample(tmp_path, kind, b"x" * 500)
    path.write_bytes(content)
    line = 3 if kind == "table" else 2  # the line after the sample's own
    limit = r"a line over 100 bytes \(grace_st\.data\.files\.MAX_LINE_BYTES\)"
    with pytest.raises(DataFileError, match=rf"line {line}: {limit}"):
        READERS[kind](path)
    errors: list[DataFileError] = []  # with on_error: reported, and the rows before it kept
    assert len(READERS[kind](path, on_error=errors.append)) == 1
    assert [error.line for error in errors] == [line]


@pytest.mark.parametrize("kind", list(READERS))
def test_more_data_than_the_limit_is_refused_a_gz_by_what_it_decompresses_to(tmp_path, monkeypatch, kind):
    from grace_st.data import files

    monkeypatch.setattr(files, "MAX_FILE_BYTES", 1000)
    path, content = sample(tmp_path, kind, b"\n" * 5000)  # blank lines: valid, and compressed to a few bytes
    path.write_bytes(content)
    if kind == "jsonl.gz":
        assert len(content) < 1000
    with pytest.raises(ValueError, match=r"over the 1,000 bytes limit|more than 1,000 bytes of data") as raised:
        READERS[kind](path)
    assert str(path) in str(raised.value)


@pytest.mark.parametrize("kind", list(READERS))
def test_every_reader_refuses_a_fifo_without_waiting_for_a_writer(tmp_path, kind):
    import os

    path, _ = sample(tmp_path, kind)
    os.mkfifo(path)
    with deadline(30), pytest.raises(ValueError, match="a named pipe \\(FIFO\\), not a regular file"):
        READERS[kind](path)


def test_text_files_are_split_at_newlines_and_decoded_by_line(tmp_path):
    file = tmp_path / "t.txt"
    file.write_bytes(b"\xef\xbb\xbfone\r\n\ntwo\x0cstill two\nbad \xff\nthree")
    errors: list[DataFileError] = []
    assert read_texts(file, on_error=errors.append) == [(1, "one"), (3, "two\x0cstill two"), (5, "three")]
    assert [(e.line, e.reason.split(":")[0]) for e in errors] == [(4, "not valid UTF-8")]
