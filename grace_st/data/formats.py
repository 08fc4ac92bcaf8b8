"""The dataset formats grace-st reads, each parsed here once for training (``grace_training.data.examples``),
the local mteb tasks (``grace_st.evaluation``) and the benchmarks (``benchmarks/dev_eval.py``):

- scored pairs (STS-B, SICK): a table with ``score``, ``sentence1``, ``sentence2``;
- labelled pairs (MRPC, Twitter URL): ``label`` 0/1 (MRPC's ``Quality``) and two sentences, a
  table or JSON lines;
- labelled texts (Banking77): ``text`` and ``label`` (``category``, ``label_name``);
- BEIR folders (SciFact): ``corpus.jsonl``, ``queries.jsonl``, ``qrels/<split>.tsv``;
- triplets: JSON lines ``{"query", "positive", "negatives": [...]}`` (WikiQA);

JSON lines may be gzip-compressed (``.jsonl.gz``).
- raw texts: ``.txt`` one a line, ``.jsonl`` or a table with a text column.

Each reader returns records that carry their 1-based line and checks what the format itself
requires (columns, numbers, labels, ids that resolve). What a consumer wants beyond that (training
skips empty sentences, mteb needs two pairs) it checks itself. ``on_error``: see
:mod:`grace_st.data.files`.
"""

from __future__ import annotations

import functools
import os
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grace_st.data.files import (
    DataFileError,
    OnError,
    Row,
    data_lines,
    decode_utf8,
    find_column,
    is_jsonl,
    parse_float,
    parse_int,
    read_jsonl,
    read_table,
    report,
)

# Accepted header names by role, first match wins; a pair table's value column comes first. MRPC ships `Quality #1 ID #2 ID #1 String #2 String`.
Columns = Mapping[str, Sequence[str]]
STS_COLUMNS: Columns = {"score": ("score",), "sentence1": ("sentence1",), "sentence2": ("sentence2",)}
PAIR_COLUMNS: Columns = {
    "label": ("label", "labels", "Quality"),
    "sentence1": ("sentence1", "#1 String"),
    "sentence2": ("sentence2", "#2 String"),
}
CLASSIFICATION_COLUMNS: Columns = {"text": ("text",), "label": ("label", "category", "label_name")}
QRELS_COLUMNS: Columns = {"query-id": ("query-id",), "corpus-id": ("corpus-id",), "score": ("score",)}


@dataclass(frozen=True)
class ScoredPair:
    line: int
    sentence1: str
    sentence2: str
    score: float


@dataclass(frozen=True)
class LabelledPair:
    line: int
    sentence1: str
    sentence2: str
    label: int


@dataclass(frozen=True)
class LabelledText:
    line: int
    text: str
    label: str


@dataclass(frozen=True)
class BeirRecord:
    """A BEIR document (``title`` may be empty) or query (no title)."""

    line: int
    text: str
    title: str = ""


@dataclass(frozen=True)
class BeirFolder:
    """A BEIR folder's records by id and its qrels ``{query id: {document id: score}}`` (every
    id resolves; scores as written, 0 included)."""

    corpus: dict[str, BeirRecord]
    queries: dict[str, BeirRecord]
    qrels: dict[str, dict[str, int]]


@dataclass(frozen=True)
class TripletRecord:
    line: int
    query: str
    positive: str
    negatives: tuple[str, ...]


def _header_columns(path: Path, header: Sequence[str], columns: Columns, on_error: OnError) -> dict[str, str] | None:
    try:
        return {role: find_column(path, header, role, names) for role, names in columns.items()}
    except DataFileError as error:
        report(error, on_error)
        return None


def _table(path: str | os.PathLike, columns: Columns, on_error: OnError) -> tuple[Path, list[Row], dict[str, str]]:
    """The rows of a table and the header name of each role (no rows when a role is missing)."""
    path = Path(path)
    header, rows = read_table(path, on_error)
    names = _header_columns(path, header, columns, on_error) if header else None
    return path, (rows if names else []), names or {}


def _pairs(
    path: str | os.PathLike, columns: Columns, on_error: OnError, parse: Callable[[Path, Row, str], Any]
) -> list[tuple[int, str, str, Any]]:
    """``(line, sentence1, sentence2, value)`` of a pair table; ``parse`` reads the value column
    (the first role), and a row whose value does not parse is reported and left out."""
    path, rows, names = _table(path, columns, on_error)
    value_column = names.get(next(iter(columns)), "")
    pairs = []
    for row in rows:
        try:
            value = parse(path, row, value_column)
        except DataFileError as error:
            report(error, on_error)
            continue
        pairs.append((row.line, row[names["sentence1"]], row[names["sentence2"]], value))
    return pairs


def read_scored_pairs(
    path: str | os.PathLike, columns: Columns = STS_COLUMNS, on_error: OnError = None
) -> list[ScoredPair]:
    """Sentence pairs with a gold similarity, any numeric range (STS-B 0–5, SICK 1–5)."""
    return [ScoredPair(*pair) for pair in _pairs(path, columns, on_error, parse_float)]


def read_labelled_pairs(
    path: str | os.PathLike, columns: Columns = PAIR_COLUMNS, on_error: OnError = None
) -> list[LabelledPair]:
    """Sentence pairs labelled 0 or 1 (paraphrase, duplicate): a table, or JSON lines
    ``{"sentence1", "sentence2", "label"}`` (the Twitter URL corpus, ``.jsonl`` or ``.jsonl.gz``)."""
    path = Path(path)
    if not is_jsonl(path):
        binary = functools.partial(parse_int, allowed=(0, 1))
        return [LabelledPair(*pair) for pair in _pairs(path, columns, on_error, binary)]
    pairs = []
    for line, item in read_jsonl(path, ("sentence1", "sentence2", "label"), on_error):
        label = item["label"]
        if label not in (0, 1) or isinstance(label, bool):
            report(DataFileError(path, line, f"label must be 0 or 1, found {label!r}"), on_error)
        elif not (isinstance(item["sentence1"], str) and isinstance(item["sentence2"], str)):
            report(DataFileError(path, line, "sentence1 and sentence2 must be strings"), on_error)
        else:
            pairs.append(LabelledPair(line, item["sentence1"], item["sentence2"], label))
    return pairs


def read_labelled_texts(
    path: str | os.PathLike, columns: Columns = CLASSIFICATION_COLUMNS, on_error: OnError = None
) -> list[LabelledText]:
    """Texts with a class label (stripped, never empty)."""
    path, rows, names = _table(path, columns, on_error)
    texts = []
    for row in rows:
        label = row[names["label"]].strip()
        if not label:
            report(DataFileError(path, row.line, f"empty {names['label']}"), on_error)
            continue
        texts.append(LabelledText(row.line, row[names["text"]], label))
    return texts


def _beir_records(path: Path, on_error: OnError) -> dict[str, BeirRecord]:
    records: dict[str, BeirRecord] = {}
    for line, item in read_jsonl(path, ("_id", "text"), on_error):
        key, text, title = item["_id"], item["text"], item.get("title", "") or ""
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            report(DataFileError(path, line, f"_id must be a string or an integer, got {key!r}"), on_error)
        elif str(key) in records:
            problem = f"duplicate _id {str(key)!r} (first on line {records[str(key)].line})"
            report(DataFileError(path, line, problem), on_error)
        elif not isinstance(text, str) or not isinstance(title, str):
            report(DataFileError(path, line, "text and title must be strings"), on_error)
        else:
            records[str(key)] = BeirRecord(line, text, title)
    if not records:
        report(DataFileError(path, 1, "no records"), on_error)
    return records


def beir_paths(folder: str | os.PathLike, split: str) -> tuple[Path, Path, Path]:
    """``corpus.jsonl``, ``queries.jsonl`` and ``qrels/<split>.tsv`` of a BEIR folder."""
    folder = Path(folder)
    return folder / "corpus.jsonl", folder / "queries.jsonl", folder / "qrels" / f"{split}.tsv"


def read_beir(folder: str | os.PathLike, split: str, on_error: OnError = None) -> BeirFolder:
    """A BEIR folder: documents ``{"_id", "title", "text"}`` (title optional), queries
    ``{"_id", "text"}``, and qrels ``query-id corpus-id score`` naming known ids."""
    corpus_path, queries_path, qrels_path = beir_paths(folder, split)
    corpus = _beir_records(corpus_path, on_error)
    queries = _beir_records(queries_path, on_error)
    path, rows, names = _table(qrels_path, QRELS_COLUMNS, on_error)
    qrels: dict[str, dict[str, int]] = defaultdict(dict)
    for row in rows:
        query_id, doc_id = row[names["query-id"]].strip(), row[names["corpus-id"]].strip()
        try:
            score = parse_int(path, row, names["score"])
            if query_id not in queries:
                raise DataFileError(path, row.line, f"query-id {query_id!r} is not in {queries_path.name}")
            if doc_id not in corpus:
                raise DataFileError(path, row.line, f"corpus-id {doc_id!r} is not in {corpus_path.name}")
        except DataFileError as error:
            report(error, on_error)
            continue
        qrels[query_id][doc_id] = score
    if not qrels:
        report(DataFileError(path, 1, "no qrels after the header"), on_error)
    return BeirFolder(corpus, queries, dict(qrels))


def is_text(value: Any) -> bool:
    """A string with something besides whitespace."""
    return isinstance(value, str) and bool(value.strip())


def read_triplets(path: str | os.PathLike, on_error: OnError = None) -> list[TripletRecord]:
    """Triplets, one JSON object a line: non-empty ``query`` and ``positive``, ``negatives`` a
    list of non-empty strings (or one ``negative``; none at all is allowed)."""
    path = Path(path)
    triplets = []
    for line, item in read_jsonl(path, (), on_error):
        negatives = item.get("negatives", [item["negative"]] if "negative" in item else [])
        if isinstance(negatives, str):
            negatives = [negatives]
        problem = None
        if not is_text(item.get("query")):
            problem = "missing or empty 'query'"
        elif not is_text(item.get("positive")):
            problem = "missing or empty 'positive'"
        elif not isinstance(negatives, list) or not all(is_text(n) for n in negatives):
            problem = "'negatives' must be a list of non-empty strings"
        if problem:
            report(DataFileError(path, line, problem), on_error)
            continue
        triplets.append(TripletRecord(line, item["query"], item["positive"], tuple(negatives)))
    return triplets


def _plain_lines(path: Path, on_error: OnError) -> Iterator[tuple[int, str]]:
    """``(line, text)`` of a one-text-a-line file, split at ``\\n`` only (``\\r\\n`` alike); a line
    that is not UTF-8 is reported and left out."""
    with data_lines(path, on_error) as lines:
        for number, raw in lines:
            try:
                text = decode_utf8(path, raw, number)
            except DataFileError as error:
                report(error, on_error)
                continue
            yield number, text.removesuffix("\n").removesuffix("\r")


def read_texts(path: str | os.PathLike, column: str = "text", on_error: OnError = None) -> list[tuple[int, str]]:
    """``(line, text)`` of the non-empty texts: ``.jsonl`` objects' ``column``, a ``.tsv``/``.csv``
    table's ``column``, or any other file one text a line."""
    path = Path(path)
    if is_jsonl(path):
        found = [(line, item.get(column)) for line, item in read_jsonl(path, (), on_error)]
    elif path.suffix in (".tsv", ".csv"):
        _, rows = read_table(path, on_error)
        found = [(row.line, row.values.get(column)) for row in rows]
    else:
        found = [(number, text) for number, text in _plain_lines(path, on_error) if text.strip()]
    texts = []
    for line, text in found:
        if is_text(text):
            texts.append((line, text))
        else:
            report(DataFileError(path, line, f"missing or empty {column!r}"), on_error)
    return texts
