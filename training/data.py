"""Training data: triplets (q, d⁺, D⁻) for GRPO (method.md §2), raw texts for the
unsupervised objective (Eqs. 12–13), scored pairs for development evaluation.

Every loader reads a whole file before training starts and reports each bad row as
``file:line: reason``. With ``bad_rows="skip"`` the row is skipped and the report printed;
with ``"error"`` the run is refused before the first step. Nothing is read lazily, so a bad
row can never stop a run midway.

Source specs (dicts, one per source; ``path`` is relative to ``data_dir`` unless absolute):

- ``{"type": "triplets", "path": "x.jsonl"}``: ``{"query", "positive", "negatives": [...]}``
  per line (``"negative": "..."`` also accepted).
- ``{"type": "beir", "path": "scifact", "split": "train"}``: ``corpus.jsonl``, ``queries.jsonl``,
  ``qrels/<split>.tsv``; one triplet per relevant (query, document); negatives mined from the
  corpus (``miner``: "bm25" or "random"), never a document relevant to that query.
- ``{"type": "pairs", "path": "stsb/train.tsv", "threshold": 4.0}``: TSV with a header and
  ``score``, ``sentence1``, ``sentence2`` columns (STS-B, SICK); pairs scored ≥ threshold are
  positives; negatives are the anchor's partners scored ≤ ``negative_threshold`` (when set),
  then mined from the file's sentences.
- ``{"type": "mrpc", "path": "mrpc/train.tsv"}``: paraphrases (Quality 1) are positives; a
  sentence's non-paraphrase partner (Quality 0) is its first negative, then mined ones.
- ``{"type": "labelled", "path": "banking77/train.csv"}``: CSV ``text,category``; two texts of
  one label form a positive pair, negatives are mined among other labels.
- ``{"type": "text", "path": "x.txt"}``: raw texts (``.txt`` one a line, ``.jsonl`` with
  ``"text"``, ``.tsv``/``.csv`` with ``column``) for the unsupervised objective.
- ``{"type": "sts", "path": "stsb/dev.tsv"}`` (evaluation only): scored pairs, all kept.

Common options: ``max_examples`` (a seeded sample), ``num_negatives``, ``miner``, ``name``.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .mining import mine_negatives

logger = logging.getLogger(__name__)

SOURCE_TYPES = ("triplets", "beir", "pairs", "mrpc", "labelled", "text", "sts")


@dataclass(frozen=True)
class Triplet:
    """One training instance: a query, its positive document, its negatives (Eq. 4's q, d⁺, D⁻).

    In the unsupervised objective ``query == positive == x`` and there are no negatives.
    ``score`` carries a gold similarity for ``sts`` evaluation pairs.
    """

    query: str
    positive: str
    negatives: tuple[str, ...] = ()
    source: str = ""
    score: float | None = None


def resolve_path(path: str, data_dir: str | None) -> Path:
    expanded = Path(os.path.expandvars(os.path.expanduser(str(path))))
    if not expanded.is_absolute() and data_dir:
        expanded = Path(os.path.expandvars(os.path.expanduser(data_dir))) / expanded
    return expanded


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _read_lines(path: Path) -> list[str]:
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file (check the data source path and data_dir)")
    return path.read_text(encoding="utf-8").splitlines()


def _read_table(path: Path, delimiter: str, issues: list[str]) -> tuple[list[str], list[tuple[int, dict[str, str]]]]:
    """Header + (line number, row) pairs; rows with the wrong field count are reported."""
    lines = _read_lines(path)
    if not lines:
        issues.append(f"{path}:1: empty file")
        return [], []
    if delimiter == ",":
        parsed = list(csv.reader(lines))
    else:
        # STS-B and MRPC sentences hold unbalanced quotes: no quoting in TSVs.
        parsed = [line.split(delimiter) for line in lines]
    header = [h.strip() for h in parsed[0]]
    rows = []
    for number, fields in enumerate(parsed[1:], start=2):
        if not fields or fields == [""]:
            continue
        if len(fields) != len(header):
            issues.append(f"{path}:{number}: expected {len(header)} fields, found {len(fields)}")
            continue
        rows.append((number, dict(zip(header, fields))))
    return header, rows


def _read_jsonl(path: Path, issues: list[str]) -> list[tuple[int, dict]]:
    rows = []
    for number, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            issues.append(f"{path}:{number}: invalid JSON ({error.msg})")
            continue
        if not isinstance(row, dict):
            issues.append(f"{path}:{number}: expected a JSON object")
            continue
        rows.append((number, row))
    return rows


# -- loaders ------------------------------------------------------------------------------------


def load_triplets_jsonl(path: Path, issues: list[str], name: str) -> list[Triplet]:
    out = []
    for number, row in _read_jsonl(path, issues):
        negatives = row.get("negatives", [row["negative"]] if "negative" in row else [])
        if isinstance(negatives, str):
            negatives = [negatives]
        problem = None
        if not _is_text(row.get("query")):
            problem = "missing or empty 'query'"
        elif not _is_text(row.get("positive")):
            problem = "missing or empty 'positive'"
        elif not isinstance(negatives, list) or not all(_is_text(n) for n in negatives):
            problem = "'negatives' must be a list of non-empty strings"
        if problem:
            issues.append(f"{path}:{number}: {problem}")
            continue
        out.append(Triplet(row["query"], row["positive"], tuple(negatives), name))
    return out


def _fraction(key: str) -> float:
    """A stable position in [0, 1) for an id: disjoint train / held-out slices of one split."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") / 2**64


def load_beir(
    folder: Path,
    split: str,
    issues: list[str],
    name: str,
    *,
    num_negatives: int,
    miner: str,
    seed: int,
    query_fraction: Sequence[float] = (0.0, 1.0),
) -> list[Triplet]:
    """BEIR folder → triplets: qrels give positives, negatives mined from the corpus.

    ``query_fraction: [lo, hi]`` keeps the queries whose id hashes into [lo, hi), e.g.
    [0, 0.9] to train and [0.9, 1] to evaluate on held-back claims of the same split.
    """
    corpus: dict[str, str] = {}
    corpus_path = folder / "corpus.jsonl"
    for number, row in _read_jsonl(corpus_path, issues):
        text = " ".join(part for part in (row.get("title") or "", row.get("text") or "") if part).strip()
        if "_id" not in row or not text:
            issues.append(f"{corpus_path}:{number}: document needs '_id' and a non-empty title or text")
            continue
        corpus[str(row["_id"])] = text
    queries: dict[str, str] = {}
    queries_path = folder / "queries.jsonl"
    for number, row in _read_jsonl(queries_path, issues):
        if "_id" not in row or not _is_text(row.get("text")):
            issues.append(f"{queries_path}:{number}: query needs '_id' and non-empty 'text'")
            continue
        queries[str(row["_id"])] = row["text"]
    qrels_path = folder / "qrels" / f"{split}.tsv"
    relevant: dict[str, list[str]] = defaultdict(list)
    _, rows = _read_table(qrels_path, "\t", issues)
    for number, row in rows:
        qid, did, score = row.get("query-id"), row.get("corpus-id"), row.get("score")
        try:
            if float(score) <= 0:
                continue
        except (TypeError, ValueError):
            issues.append(f"{qrels_path}:{number}: score {score!r} is not a number")
            continue
        if qid in queries and not query_fraction[0] <= _fraction(qid) < query_fraction[1]:
            continue
        if qid not in queries:
            issues.append(f"{qrels_path}:{number}: query-id {qid!r} not in queries.jsonl")
        elif did not in corpus:
            issues.append(f"{qrels_path}:{number}: corpus-id {did!r} not in corpus.jsonl")
        else:
            relevant[qid].append(did)
    doc_ids = list(corpus)
    doc_index = {d: i for i, d in enumerate(doc_ids)}
    pairs = [(qid, did) for qid, dids in relevant.items() for did in dids]
    mined = mine_negatives(
        [queries[q] for q, _ in pairs],
        [corpus[d] for d in doc_ids],
        [{doc_index[d] for d in relevant[q]} for q, _ in pairs],
        num_negatives,
        miner=miner,
        seed=seed,
    )
    return [
        Triplet(queries[q], corpus[d], tuple(corpus[doc_ids[i]] for i in negs), name)
        for (q, d), negs in zip(pairs, mined)
    ]


def _pairs_to_triplets(
    positives: list[tuple[str, str]],
    negative_partners: dict[str, list[str]],
    related: dict[str, set[str]],
    name: str,
    *,
    num_negatives: int,
    miner: str,
    seed: int,
) -> list[Triplet]:
    """Positive pairs → triplets; given partners first, then mined texts of the pair pool."""
    pool = sorted({t for pair in positives for t in pair} | {t for ts in negative_partners.values() for t in ts})
    index = {t: i for i, t in enumerate(pool)}
    given = [list(dict.fromkeys(negative_partners.get(a, [])))[:num_negatives] for a, _ in positives]
    exclude = [
        {index[a], index[b], *(index[t] for t in related.get(a, ())), *(index[t] for t in g)}
        for (a, b), g in zip(positives, given)
    ]
    need = max((num_negatives - len(g) for g in given), default=0)
    mined = mine_negatives([a for a, _ in positives], pool, exclude, need, miner=miner, seed=seed)
    return [
        Triplet(a, b, tuple(g + [pool[i] for i in m][: num_negatives - len(g)]), name)
        for (a, b), g, m in zip(positives, given, mined)
    ]


def load_scored_pairs(
    path: Path,
    issues: list[str],
    *,
    score_column: str = "score",
    columns: Sequence[str] = ("sentence1", "sentence2"),
) -> list[tuple[str, str, float]]:
    _, rows = _read_table(path, "\t", issues)
    out = []
    for number, row in rows:
        try:
            score = float(row[score_column])
        except (KeyError, ValueError):
            issues.append(f"{path}:{number}: score {row.get(score_column)!r} is not a number")
            continue
        a, b = row.get(columns[0]), row.get(columns[1])
        if not (_is_text(a) and _is_text(b)):
            issues.append(f"{path}:{number}: empty sentence")
            continue
        out.append((a, b, score))
    return out


def load_pairs(
    path: Path,
    issues: list[str],
    name: str,
    *,
    threshold: float,
    negative_threshold: float | None,
    num_negatives: int,
    miner: str,
    seed: int,
    **columns,
) -> list[Triplet]:
    scored = load_scored_pairs(path, issues, **columns)
    positives = [(a, b) for a, b, s in scored if s >= threshold]
    related: dict[str, set[str]] = defaultdict(set)
    for a, b in positives:
        related[a].add(b)
        related[b].add(a)
    partners: dict[str, list[str]] = defaultdict(list)
    if negative_threshold is not None:
        for a, b, s in scored:
            if s <= negative_threshold:
                partners[a].append(b)
    return _pairs_to_triplets(positives, partners, related, name, num_negatives=num_negatives, miner=miner, seed=seed)


def load_mrpc(path: Path, issues: list[str], name: str, *, num_negatives: int, miner: str, seed: int) -> list[Triplet]:
    _, rows = _read_table(path, "\t", issues)
    positives, partners, related = [], defaultdict(list), defaultdict(set)
    for number, row in rows:
        quality, a, b = row.get("Quality"), row.get("#1 String"), row.get("#2 String")
        if quality not in ("0", "1") or not (_is_text(a) and _is_text(b)):
            issues.append(f"{path}:{number}: needs Quality 0/1 and two non-empty strings")
            continue
        if quality == "1":
            positives.append((a, b))
            related[a].add(b)
            related[b].add(a)
        else:
            partners[a].append(b)
            partners[b].append(a)
    return _pairs_to_triplets(positives, partners, related, name, num_negatives=num_negatives, miner=miner, seed=seed)


def load_labelled(
    path: Path,
    issues: list[str],
    name: str,
    *,
    num_negatives: int,
    miner: str,
    seed: int,
    text_column: str = "text",
    label_column: str = "category",
) -> list[Triplet]:
    delimiter = "\t" if path.suffix == ".tsv" else ","
    _, rows = _read_table(path, delimiter, issues)
    by_label: dict[str, list[str]] = defaultdict(list)
    for number, row in rows:
        text, label = row.get(text_column), row.get(label_column)
        if not (_is_text(text) and _is_text(label)):
            issues.append(f"{path}:{number}: needs non-empty {text_column!r} and {label_column!r}")
            continue
        by_label[label].append(text)
    rng = random.Random(seed)
    positives = []
    for texts in by_label.values():
        for i, text in enumerate(texts):
            if len(texts) > 1:
                j = rng.choice([k for k in range(len(texts)) if k != i])
                positives.append((text, texts[j]))
    related = {t: set(ts) for ts in by_label.values() for t in ts}
    return _pairs_to_triplets(positives, {}, related, name, num_negatives=num_negatives, miner=miner, seed=seed)


def load_texts(path: Path, issues: list[str], name: str, *, column: str = "text") -> list[Triplet]:
    texts: list[tuple[int, Any]]
    if path.suffix == ".jsonl":
        texts = [(n, row.get(column)) for n, row in _read_jsonl(path, issues)]
    elif path.suffix in (".tsv", ".csv"):
        _, rows = _read_table(path, "\t" if path.suffix == ".tsv" else ",", issues)
        texts = [(n, row.get(column)) for n, row in rows]
    else:
        texts = [(n, line) for n, line in enumerate(_read_lines(path), start=1) if line.strip()]
    out = []
    for number, text in texts:
        if not _is_text(text):
            issues.append(f"{path}:{number}: missing or empty {column!r}")
            continue
        out.append(Triplet(text, text, (), name))
    return out


# -- entry points -------------------------------------------------------------------------------


def load_source(
    spec: dict[str, Any], issues: list[str], *, data_dir: str | None = None, num_negatives: int = 1, seed: int = 0
) -> list[Triplet]:
    """Load one source spec (see the module docstring); bad rows are appended to ``issues``."""
    spec = dict(spec)
    kind = spec.pop("type")
    if kind not in SOURCE_TYPES:
        raise ValueError(f"unknown data source type {kind!r}; one of {SOURCE_TYPES}")
    path = resolve_path(spec.pop("path"), data_dir)
    name = spec.pop("name", path.name if kind == "beir" else f"{path.parent.name}/{path.stem}")
    max_examples = spec.pop("max_examples", None)
    mining = {
        "num_negatives": int(spec.pop("num_negatives", num_negatives)),
        "miner": spec.pop("miner", "bm25"),
        "seed": seed,
    }
    if kind == "triplets":
        rows = load_triplets_jsonl(path, issues, name)
    elif kind == "beir":
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: no such BEIR folder (check the data source path and data_dir)")
        fraction = tuple(float(x) for x in spec.pop("query_fraction", (0.0, 1.0)))
        rows = load_beir(path, spec.pop("split", "train"), issues, name, **mining, query_fraction=fraction)
    elif kind == "pairs":
        rows = load_pairs(
            path,
            issues,
            name,
            threshold=float(spec.pop("threshold", 4.0)),
            negative_threshold=spec.pop("negative_threshold", None),
            **mining,
            **_columns(spec),
        )
    elif kind == "mrpc":
        rows = load_mrpc(path, issues, name, **mining)
    elif kind == "labelled":
        rows = load_labelled(path, issues, name, **mining, **spec)
        spec = {}
    elif kind == "text":
        rows = load_texts(path, issues, name, **spec)
        spec = {}
    else:  # sts
        rows = [Triplet(a, b, (), name, s) for a, b, s in load_scored_pairs(path, issues, **_columns(spec))]
    if spec:
        raise ValueError(f"unknown option(s) for a {kind!r} source: {', '.join(sorted(spec))}")
    if max_examples is not None and len(rows) > int(max_examples):
        rows = random.Random(seed).sample(rows, int(max_examples))
    return rows


def _columns(spec: dict[str, Any]) -> dict[str, Any]:
    columns = {}
    if "score_column" in spec:
        columns["score_column"] = spec.pop("score_column")
    if "columns" in spec:
        columns["columns"] = tuple(spec.pop("columns"))
    return columns


def to_unsupervised(rows: list[Triplet]) -> list[Triplet]:
    """Raw texts x (Eqs. 12–13) from any source: each distinct query and positive once."""
    seen = dict.fromkeys(t for row in rows for t in (row.query, row.positive))
    source = {t: row.source for row in rows for t in (row.query, row.positive)}
    return [Triplet(t, t, (), source[t]) for t in seen]


def _issue_position(issue: str) -> tuple[str, int]:
    path, _, rest = issue.partition(":")
    line = rest.split(":", 1)[0]
    return path, int(line) if line.isdigit() else 0


def load_data(
    specs: list[dict[str, Any]],
    *,
    bad_rows: str = "skip",
    data_dir: str | None = None,
    num_negatives: int = 1,
    seed: int = 0,
    objective: str = "supervised",
) -> tuple[list[Triplet], list[str]]:
    """All sources of a run, or ValueError before training when ``bad_rows="error"`` and a row is bad."""
    issues: list[str] = []
    rows: list[Triplet] = []
    for spec in specs:
        rows.extend(load_source(spec, issues, data_dir=data_dir, num_negatives=num_negatives, seed=seed))
    if objective == "unsupervised":
        rows = to_unsupervised(rows)
    issues.sort(key=_issue_position)
    if issues:
        shown = "\n  ".join(issues[:20])
        more = f"\n  ... and {len(issues) - 20} more" if len(issues) > 20 else ""
        if bad_rows == "error":
            raise ValueError(f"{len(issues)} bad data row(s) (bad_rows=error):\n  {shown}{more}")
        logger.warning("skipped %d bad data row(s):\n  %s%s", len(issues), shown, more)
    return rows, issues
