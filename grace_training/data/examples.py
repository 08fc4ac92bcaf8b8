"""Training data: triplets (q, d⁺, D⁻) for GRPO (method.md §2), raw texts for the
unsupervised objective (Eqs. 12–13), scored pairs for development evaluation.

Files are parsed by the data layer (:mod:`grace_st.data`, shared with evaluation and the
benchmarks); this module turns its records into training instances. Every loader reads a whole
file before training starts and reports each bad row as ``file:line: reason``. With
``bad_rows="skip"`` the row is skipped and the report printed;
with ``"error"`` the run is refused before the first step. Nothing is read lazily, so a bad
row can never stop a run midway.

Source specs (dicts, one per source; ``path`` is relative to ``data_dir`` unless absolute):

- ``{"type": "triplets", "path": "x.jsonl"}``: ``{"query", "positive", "negatives": [...]}``
  per line (``"negative": "..."`` also accepted; ``.jsonl.gz`` read through gzip, e.g. WikiQA).
- ``{"type": "beir", "path": "scifact", "split": "train"}``: ``corpus.jsonl``, ``queries.jsonl``,
  ``qrels/<split>.tsv``; one triplet per relevant (query, document); negatives mined from the
  corpus (``miner``: "bm25" or "random"), never a document relevant to that query.
- ``{"type": "pairs", "path": "stsb/train.tsv", "threshold": 4.0}``: TSV with a header and
  ``score``, ``sentence1``, ``sentence2`` columns (STS-B, SICK); pairs scored ≥ threshold are
  positives; negatives are the anchor's partners scored ≤ ``negative_threshold`` (when set),
  then mined from the file's sentences.
- ``{"type": "mrpc", "path": "mrpc/train.tsv"}``: paraphrases (Quality 1) are positives; a
  sentence's non-paraphrase partner (Quality 0) is its first negative, then mined ones. Any
  labelled-pair file: a table or JSON lines (``twitter_url/pairs.jsonl.gz``, whose
  non-paraphrases share the paraphrase's topic: hard negatives).
- ``{"type": "labelled", "path": "banking77/train.csv"}``: CSV ``text,category``; two texts of
  one label form a positive pair, negatives are mined among other labels.
- ``{"type": "text", "path": "x.txt"}``: raw texts (``.txt`` one a line, ``.jsonl`` with
  ``"text"``, ``.tsv``/``.csv`` with ``column``) for the unsupervised objective.
- ``{"type": "sts", "path": "stsb/dev.tsv"}``: scored pairs, all kept, with their scores. For evaluation
  a Spearman; for training graded pairs (a batch of its own, one greedy rollout a text, β · CoSENT on
  the scores instead of InfoNCE; ``TrainConfig.graded_scale``).

Common options: ``max_examples`` (a seeded sample), ``num_negatives``, ``miner``, ``name``;
``symmetric: true`` (both sides the same kind of text, e.g. STS pairs: every role takes the
encoder's ``"default"`` prompt type, as ``encode`` embeds such text), ``weight`` (how often a
step draws its batch from this source under ``batch_sampling: by_source``; default: its size).

The module holds one loader per source kind (BEIR, scored pairs, MRPC, labelled texts, raw text, triplets), each
turning :mod:`grace_st.data` records into triplets through the shared mining and bad-row policy.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grace_st.data import DataFileError, formats, id_fraction, scoreboard_sample
from grace_training.data.mining import mine_negatives

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
    symmetric: bool = False  # both sides are the same kind of text: every role takes the "default" prompt type


def resolve_path(path: str, data_dir: str | None) -> Path:
    expanded = Path(os.path.expandvars(os.path.expanduser(str(path))))
    if not expanded.is_absolute() and data_dir:
        expanded = Path(os.path.expandvars(os.path.expanduser(data_dir))) / expanded
    return expanded


def _collect(issues: list[str]) -> Callable[[DataFileError], None]:
    """The data layer's ``on_error``: each bad row becomes a ``file:line: reason`` issue."""
    return lambda error: issues.append(f"{error.path}:{error.line}: {error.reason}")


# -- loaders ------------------------------------------------------------------------------------


def load_triplets_jsonl(path: Path, issues: list[str], name: str) -> list[Triplet]:
    return [Triplet(t.query, t.positive, t.negatives, name) for t in formats.read_triplets(path, _collect(issues))]


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
    folder_data = formats.read_beir(folder, split, _collect(issues))
    corpus: dict[str, str] = {}
    for doc_id, record in folder_data.corpus.items():
        text = " ".join(part for part in (record.title, record.text) if part).strip()
        if text:
            corpus[doc_id] = text
        else:
            issues.append(f"{folder / 'corpus.jsonl'}:{record.line}: document needs a non-empty title or text")
    queries: dict[str, str] = {}
    for query_id, record in folder_data.queries.items():
        if formats.is_text(record.text):
            queries[query_id] = record.text
        else:
            issues.append(f"{folder / 'queries.jsonl'}:{record.line}: query needs non-empty 'text'")
    relevant: dict[str, list[str]] = defaultdict(list)
    for query_id, scores in folder_data.qrels.items():
        if query_id in queries and query_fraction[0] <= id_fraction(query_id) < query_fraction[1]:
            relevant[query_id].extend(d for d, score in scores.items() if score > 0 and d in corpus)
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
    roles = {"score": (score_column,), "sentence1": (columns[0],), "sentence2": (columns[1],)}
    out = []
    for pair in formats.read_scored_pairs(path, roles, _collect(issues)):
        if not (formats.is_text(pair.sentence1) and formats.is_text(pair.sentence2)):
            issues.append(f"{path}:{pair.line}: empty sentence")
            continue
        out.append((pair.sentence1, pair.sentence2, pair.score))
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
    positives, partners, related = [], defaultdict(list), defaultdict(set)
    for pair in formats.read_labelled_pairs(path, on_error=_collect(issues)):
        a, b = pair.sentence1, pair.sentence2
        if not (formats.is_text(a) and formats.is_text(b)):
            issues.append(f"{path}:{pair.line}: needs two non-empty strings")
            continue
        if pair.label == 1:
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
    text_column: str | None = None,
    label_column: str | None = None,
    hold_out_scoreboard: int = 0,
) -> list[Triplet]:
    """Two texts of one label form a positive pair. ``hold_out_scoreboard: N`` leaves out the N
    rows the development scoreboard samples from this file (``dev_eval.py``'s Banking77 kNN sets,
    N = train + test texts: 800 for ``--banking-train 500 --banking-test 300``), so that score
    stays one of texts training never saw."""
    roles = dict(formats.CLASSIFICATION_COLUMNS)
    if text_column is not None:
        roles["text"] = (text_column,)
    if label_column is not None:
        roles["label"] = (label_column,)
    items = formats.read_labelled_texts(path, roles, _collect(issues))
    if hold_out_scoreboard:
        held = {item.line for item in scoreboard_sample(items, int(hold_out_scoreboard), path.parent.name)}
        items = [item for item in items if item.line not in held]
    by_label: dict[str, list[str]] = defaultdict(list)
    for item in items:
        if not formats.is_text(item.text):
            issues.append(f"{path}:{item.line}: empty text")
            continue
        by_label[item.label].append(item.text)
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
    return [Triplet(text, text, (), name) for _, text in formats.read_texts(path, column, _collect(issues))]


# -- entry points -------------------------------------------------------------------------------


def load_source(
    spec: dict[str, Any], issues: list[str], *, data_dir: str | None = None, num_negatives: int = 1, seed: int = 0
) -> list[Triplet]:
    """Load one source spec (see the module docstring); bad rows are appended to ``issues``."""
    spec = dict(spec)
    kind = spec.pop("type")
    if kind not in SOURCE_TYPES:
        raise ValueError(f"unknown data source type {kind!r}; one of {SOURCE_TYPES}")
    name = source_name({"type": kind, **spec}, data_dir)
    path = resolve_path(spec.pop("path"), data_dir)
    spec.pop("name", None)
    spec.pop("weight", None)  # read by source_weights: how often the run draws a batch of this source
    symmetric = spec.pop("symmetric", kind == "text")  # raw texts are one kind of text, as encode embeds them
    if not isinstance(symmetric, bool):
        raise ValueError(f"{name}: 'symmetric' must be true or false, got {symmetric!r}")
    max_examples = spec.pop("max_examples", None)
    mining = {
        "num_negatives": int(spec.pop("num_negatives", num_negatives)),
        "miner": spec.pop("miner", "bm25"),
        "seed": seed,
    }
    if kind != "beir":
        _require_file(path)
    if kind == "triplets":
        rows = load_triplets_jsonl(path, issues, name)
    elif kind == "beir":
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: no such BEIR folder (check the data source path and data_dir)")
        split = spec.pop("split", "train")
        for file in formats.beir_paths(path, split):
            _require_file(file)
        fraction = tuple(float(x) for x in spec.pop("query_fraction", (0.0, 1.0)))
        rows = load_beir(path, split, issues, name, **mining, query_fraction=fraction)
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
    if symmetric:
        rows = [dataclasses.replace(row, symmetric=True) for row in rows]
    return rows


def source_name(spec: dict[str, Any], data_dir: str | None = None) -> str:
    """The name a source's triplets carry (``Triplet.source``): ``name``, else from its path."""
    if "name" in spec:
        return str(spec["name"])
    path = resolve_path(spec["path"], data_dir)
    stem = path.name.removesuffix(".gz")
    return path.name if spec["type"] == "beir" else f"{path.parent.name}/{Path(stem).stem}"


def source_weights(
    specs: list[dict[str, Any]], rows: Sequence[Triplet], data_dir: str | None = None
) -> dict[str, float]:
    """Each source's sampling weight: its spec's ``weight``, else its number of triplets (proportional)."""
    sizes: dict[str, int] = defaultdict(int)
    for row in rows:
        sizes[row.source] += 1
    weights = {}
    for spec in specs:
        name = source_name(spec, data_dir)
        weight = spec.get("weight", sizes[name])
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
            raise ValueError(f"{name}: 'weight' must be a number >= 0, got {weight!r}")
        weights[name] = float(weight)
    return weights


def _require_file(path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (check the data source path and data_dir)")


def _columns(spec: dict[str, Any]) -> dict[str, Any]:
    columns = {}
    if "score_column" in spec:
        columns["score_column"] = spec.pop("score_column")
    if "columns" in spec:
        columns["columns"] = tuple(spec.pop("columns"))
    return columns


def to_unsupervised(rows: list[Triplet]) -> list[Triplet]:
    """Raw texts x (Eqs. 12–13) from any source: each distinct query and positive once, keeping its source's
    ``symmetric`` (whether x is embedded with the ``"default"`` prompt type or as a query and a document)."""
    seen = dict.fromkeys(t for row in rows for t in (row.query, row.positive))
    origin: dict[str, Triplet] = {}
    for row in rows:
        origin.setdefault(row.query, row)
        origin.setdefault(row.positive, row)
    return [Triplet(t, t, (), origin[t].source, symmetric=origin[t].symmetric) for t in seen]


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


def cap_per_source(rows: list[Triplet], cap: int, seed: int) -> list[Triplet]:
    """At most ``cap`` rows of each source (a seeded sample; 0: all), for quick evaluations."""
    if not cap:
        return rows
    by_source: dict[str, list[Triplet]] = {}
    for row in rows:
        by_source.setdefault(row.source, []).append(row)
    out = []
    for items in by_source.values():
        out.extend(items if len(items) <= cap else random.Random(seed).sample(items, cap))
    return out
