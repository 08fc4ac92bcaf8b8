"""mteb tasks read from local files, so that ``mteb.evaluate`` runs with no Hub access.

Each class subclasses mteb's own abstract task (``AbsTaskSTS``, ``AbsTaskRetrieval``,
``AbsTaskClassification``, ``AbsTaskPairClassification``), carries a ``TaskMetadata`` of its
own and overrides ``load_data`` to read the file instead of calling ``datasets.load_dataset``.
Scoring is mteb's, unchanged.

Shared guarantees:

- Malformed input (a missing column, an unparsable score or label, a malformed JSON line,
  qrels naming an unknown query or document) raises :class:`DataFileError`, a ``ValueError``
  whose message starts with ``"<path>, line <n>: "`` (1-based; line 1 is a table's header).
- Files are read one line at a time under :mod:`grace_st.data.files`' limits: a device, a FIFO
  or a directory where a file belongs, a file over 1 GiB or a line over 8 MiB is refused naming
  the file (and the line), before the file is read whole.
- ``limit`` subsamples deterministically: the same file and options always give the same
  rows, on any platform.
- The metadata's dataset ``revision`` is a hash of the file contents and of the options, so
  mteb's result cache never mixes results computed on different data.

Every task also takes ``name``, its name in results (default ``<folder>-<file stem>``, or a BEIR
folder's name), and ``language``, the BCP-47 language-script code for mteb's metadata (default
``eng-Latn``).

The module holds four task classes and the metadata and sampling helpers they share; each class is its
constructor and a ``_read`` over :mod:`grace_st.data`.
"""

from __future__ import annotations

import logging
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, NamedTuple

from datasets import Dataset, DatasetDict
from mteb.abstasks.classification import AbsTaskClassification
from mteb.abstasks.pair_classification import AbsTaskPairClassification
from mteb.abstasks.retrieval import AbsTaskRetrieval
from mteb.abstasks.sts import AbsTaskSTS
from mteb.abstasks.task_metadata import TaskMetadata

from grace_st.data.files import SAMPLING_SEED, DataFileError, fingerprint, sample_indices, sample_keys, shuffled
from grace_st.data.formats import beir_paths, read_beir, read_labelled_pairs, read_labelled_texts, read_scored_pairs

logger = logging.getLogger(__name__)

__all__ = [
    "DataFileError",
    "LocalClassificationTask",
    "LocalPairClassificationTask",
    "LocalRetrievalTask",
    "LocalSTSTask",
    "classification_task",
    "pair_classification_task",
    "retrieval_task",
    "sts_task",
]


def _default_name(path: Path, prefix: str) -> str:
    """``stsb/dev.tsv`` -> ``"stsb-dev"``; a BEIR folder ``scifact/`` -> ``"scifact"``."""
    path = path.resolve()
    parts = [path.name] if path.is_dir() else [path.parent.name, path.stem]
    name = "-".join(part for part in parts if part) or prefix
    return re.sub(r"[^\w.-]+", "_", name)


def _check_name(name: str) -> str:
    # mteb writes `<cache>/.../<task name>.json`: a separator would escape that folder.
    if not name or "/" in name or os.sep in name or name in (".", ".."):
        raise ValueError(f"task name {name!r} must be a non-empty file name without path separators")
    return name


def _check_limit(limit: int | None, minimum: int = 1) -> int | None:
    if limit is not None and (not isinstance(limit, int) or limit < minimum):
        raise ValueError(f"limit must be an int >= {minimum} or None, got {limit!r}")
    return limit


class _Kind(NamedTuple):
    """What one local task class is, in mteb's terms."""

    task_type: str
    category: str
    main_score: str
    default_name: str  # the name when neither ``name`` nor the path gives one
    reads: str  # what the description says it reads


_STS = _Kind("STS", "t2t", "cosine_spearman", "sts", "STS pairs")
_PAIRS = _Kind("PairClassification", "t2t", "max_ap", "pairs", "sentence pairs with 0/1 labels")
_CLASSIFICATION = _Kind("Classification", "t2c", "accuracy", "classification", "labelled texts")
_RETRIEVAL = _Kind("Retrieval", "t2t", "ndcg_at_10", "retrieval", "BEIR retrieval data")


def _metadata(
    kind: _Kind,
    source: Path,
    name: str | None,
    language: str,
    options: dict[str, Any],
    paths: list[Path] | None = None,
    where: str | None = None,
    eval_split: str = "test",
) -> TaskMetadata:
    """mteb metadata for a task of ``kind`` read from ``paths`` (default: ``[source]``); the dataset
    revision is a fingerprint of those files and of ``options``, so results of other data are never
    reused. ``where`` is how the description names the source (default: its path)."""
    paths = [source] if paths is None else paths
    name = name or _default_name(source, kind.default_name)
    description = f"Local {kind.reads} read from {where or source}."
    return TaskMetadata(
        name=_check_name(name),
        description=description,
        dataset={"path": str(source.resolve()), "revision": fingerprint(paths, **options)},
        type=kind.task_type,
        category=kind.category,
        modalities=["text"],
        eval_splits=[eval_split],
        eval_langs=[language],
        main_score=kind.main_score,
        domains=[],
        task_subtypes=[],
        license="not specified",
        annotations_creators=None,
        dialect=[],
        sample_creation="found",
        bibtex_citation="",
    )


def _pairs_split(pairs, column: str, values: list) -> DatasetDict:
    """A ``test`` split of sentence pairs with one more column (the score or the label)."""
    columns = {"sentence1": [p.sentence1 for p in pairs], "sentence2": [p.sentence2 for p in pairs], column: values}
    return DatasetDict({"test": Dataset.from_dict(columns)})


class _LocalTaskMixin:
    """Instance metadata and a local ``load_data`` for mteb's abstract tasks."""

    metadata: TaskMetadata
    dataset: Any
    data_loaded: bool

    def __init__(self, metadata: TaskMetadata, seed: int = SAMPLING_SEED, **kwargs: Any) -> None:
        # AbsTask.__init__ reads self.metadata, so it must exist first.
        self.metadata = metadata
        super().__init__(seed=seed, **kwargs)

    def load_data(self, num_proc: int | None = None, **kwargs: Any) -> None:
        """Read the local file(s) into ``self.dataset``; idempotent. Never touches the Hub."""
        if self.data_loaded:
            return
        self.dataset = self._read()
        self.data_loaded = True

    def _read(self) -> Any:
        raise NotImplementedError

    def unload_data(self) -> None:
        # mteb's unload_data also drops an instance `metadata`, falling back to the class's
        # (registry tasks define it on the class). Ours only exists on the instance: keep it.
        self.dataset = None
        self.data_loaded = False


class LocalSTSTask(_LocalTaskMixin, AbsTaskSTS):
    """Semantic textual similarity from a CSV/TSV with a header naming ``score``,
    ``sentence1`` and ``sentence2`` (other columns are ignored).

    Scores may use any numeric range (STS-B 0–5, SICK 1–5, ...). mteb normalises with
    ``(score - min_score) / (max_score - min_score)``; the bounds default to the smallest and
    largest score in the whole file (before ``limit``), so normalised scores lie in [0, 1].
    Correlations (the main score is ``cosine_spearman``) do not depend on this choice.

    Args (and ``name``, ``language``: see the module docstring):
        path: the file.
        limit: evaluate at most this many pairs, a deterministic sample.
        score_range: ``(min_score, max_score)`` instead of the file's observed range.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        name: str | None = None,
        limit: int | None = None,
        score_range: tuple[float, float] | None = None,
        language: str = "eng-Latn",
    ) -> None:
        self.path = Path(path)
        self.limit = _check_limit(limit, minimum=2)
        self.score_range = score_range
        if score_range is not None and not score_range[0] < score_range[1]:
            raise ValueError(f"score_range must be (min, max) with min < max, got {score_range!r}")
        options = {"limit": limit, "score_range": score_range}
        super().__init__(_metadata(_STS, self.path, name, language, options))

    def _read(self) -> DatasetDict:
        pairs = read_scored_pairs(self.path)
        if not pairs:
            raise DataFileError(self.path, 1, "no data rows after the header")
        scores = [pair.score for pair in pairs]
        low, high = self.score_range or (min(scores), max(scores))
        if low == high:
            raise DataFileError(self.path, pairs[0].line, f"every score is {low}: correlations are undefined")
        # Instance attributes shadow AbsTaskSTS's class defaults (0, 5) used by _normalize.
        self.min_score, self.max_score = low, high
        keep = [pairs[i] for i in sample_indices(len(pairs), self.limit)]
        return _pairs_split(keep, "score", [pair.score for pair in keep])


class LocalPairClassificationTask(_LocalTaskMixin, AbsTaskPairClassification):
    """Pair classification (paraphrase / duplicate detection) from a CSV/TSV.

    Accepted headers: ``label sentence1 sentence2`` (also ``labels``), or MRPC's
    ``Quality #1 ID #2 ID #1 String #2 String``. Labels must be 0 or 1. The main score is
    ``max_ap``.

    Args (and ``name``, ``language``: see the module docstring):
        path: the file.
        limit: evaluate at most this many pairs (at least 2), a deterministic sample.
    """

    def __init__(
        self, path: str | os.PathLike, name: str | None = None, limit: int | None = None, language: str = "eng-Latn"
    ) -> None:
        self.path = Path(path)
        # mteb treats a one-row pair dataset as its v1 layout (one row of lists): need >= 2.
        self.limit = _check_limit(limit, minimum=2)
        super().__init__(_metadata(_PAIRS, self.path, name, language, {"limit": limit}))

    def _read(self) -> DatasetDict:
        pairs = read_labelled_pairs(self.path)
        if len(pairs) < 2:
            raise DataFileError(self.path, pairs[0].line if pairs else 1, "need at least 2 pairs")
        keep = [pairs[i] for i in sample_indices(len(pairs), self.limit)]
        if len({pair.label for pair in keep}) < 2:
            logger.warning("%s: the evaluated pairs all have one label; average precision is degenerate", self.path)
        return _pairs_split(keep, "labels", [pair.label for pair in keep])


class LocalClassificationTask(_LocalTaskMixin, AbsTaskClassification):
    """Text classification from a CSV/TSV with a header naming ``text`` and ``label`` (or
    ``category``, as Banking77 ships it, or ``label_name``).

    mteb trains a logistic regression on few-shot samples of the ``train`` split
    (``samples_per_label`` per label, ``n_experiments`` times) and scores the ``test`` split;
    the main score is ``accuracy``. With one file, a deterministic stratified split puts
    ``test_size`` of each label's rows in ``test`` (a label with one row stays in ``train``);
    with ``test_path``, that file is the test split. Labels are stored as ints, in the
    order of :attr:`label_names` (sorted).

    Args (and ``name``, ``language``: see the module docstring):
        path: the (training) file.
        limit: at most this many test texts (a deterministic sample) and at most this many
            training texts (drawn round-robin over labels so every label keeps examples).
        test_path: a separate test file in the same format.
        test_size: fraction of each label's rows held out when there is no ``test_path``.
        samples_per_label, n_experiments: mteb's few-shot classifier settings.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        name: str | None = None,
        limit: int | None = None,
        test_path: str | os.PathLike | None = None,
        test_size: float = 0.2,
        samples_per_label: int = 8,
        n_experiments: int = 10,
        language: str = "eng-Latn",
    ) -> None:
        self.path = Path(path)
        self.test_path = Path(test_path) if test_path is not None else None
        self.limit = _check_limit(limit)
        if not 0 < test_size < 1:
            raise ValueError(f"test_size must be in (0, 1), got {test_size!r}")
        self.test_size = test_size
        # Instance attributes shadow AbsTaskClassification's class defaults.
        self.samples_per_label = samples_per_label
        self.n_experiments = n_experiments
        self.label_names: list[str] = []
        paths = [self.path] + ([self.test_path] if self.test_path else [])
        options = {
            "limit": limit,
            "test_size": None if test_path else test_size,
            "samples_per_label": samples_per_label,
            "n_experiments": n_experiments,
        }
        where = ", ".join(str(p) for p in paths)
        super().__init__(_metadata(_CLASSIFICATION, self.path, name, language, options, paths=paths, where=where))

    def _read_labelled(self, path: Path) -> list[tuple[int, str, str]]:
        items = [(item.line, item.text, item.label) for item in read_labelled_texts(path)]
        if not items:
            raise DataFileError(path, 1, "no data rows after the header")
        return items

    def _read(self) -> DatasetDict:
        train = self._read_labelled(self.path)
        if self.test_path is not None:
            test = self._read_labelled(self.test_path)
        else:
            train, test = self._split(train)
            if not test:
                raise DataFileError(self.path, 1, "too few rows per label to hold out a test split")
        if self.limit is not None:
            test = [test[i] for i in sample_indices(len(test), self.limit)]
            train = self._round_robin(train, self.limit)
        names = {label for _, _, label in train + test}
        # Numeric labels sort as numbers ("2" before "10"), others as strings.
        self.label_names = sorted(names, key=lambda n: (0, int(n), "") if re.fullmatch(r"-?\d+", n) else (1, 0, n))
        index = {label: i for i, label in enumerate(self.label_names)}

        def to_dataset(items: list[tuple[int, str, str]]) -> Dataset:
            texts = [text for _, text, _ in items]
            return Dataset.from_dict({"text": texts, "label": [index[label] for _, _, label in items]})

        return DatasetDict({"train": to_dataset(train), "test": to_dataset(test)})

    def _split(self, items: list[tuple[int, str, str]]) -> tuple[list, list]:
        by_label: dict[str, list[int]] = defaultdict(list)
        for position, (_, _, label) in enumerate(items):
            by_label[label].append(position)
        held_out: set[int] = set()
        for label in sorted(by_label):
            positions = by_label[label]
            if len(positions) < 2:
                continue
            count = min(max(1, round(len(positions) * self.test_size)), len(positions) - 1)
            order = shuffled([f"{label}\x00{p}" for p in positions])
            held_out.update(int(key.rsplit("\x00", 1)[1]) for key in order[:count])
        train = [item for p, item in enumerate(items) if p not in held_out]
        test = [item for p, item in enumerate(items) if p in held_out]
        return train, test

    @staticmethod
    def _round_robin(items: list[tuple[int, str, str]], limit: int) -> list:
        if limit >= len(items):
            return items
        by_label: dict[str, list[int]] = defaultdict(list)
        for position, (_, _, label) in enumerate(items):
            by_label[label].append(position)
        queues = {label: shuffled([str(p) for p in positions]) for label, positions in by_label.items()}
        chosen: set[int] = set()
        labels = sorted(queues)
        depth = 0
        while len(chosen) < limit:
            for label in labels:
                if depth < len(queues[label]) and len(chosen) < limit:
                    chosen.add(int(queues[label][depth]))
            depth += 1
        return [item for p, item in enumerate(items) if p in chosen]


def _default_split(beir_dir: Path) -> str:
    available = sorted(p.stem for p in (beir_dir / "qrels").glob("*.tsv"))
    if "test" in available or not available:
        return "test"  # a missing file is reported with the folder's contents below
    if len(available) == 1:
        return available[0]
    raise ValueError(f"{beir_dir}: several qrels splits ({', '.join(available)}); choose one with split=")


class LocalRetrievalTask(_LocalTaskMixin, AbsTaskRetrieval):
    """Retrieval from a BEIR folder: ``corpus.jsonl`` (``{"_id", "title", "text"}``, title
    optional), ``queries.jsonl`` (``{"_id", "text"}``) and ``qrels/<split>.tsv`` with the header
    ``query-id corpus-id score``. Queries without a qrels line are not evaluated, as in mteb.
    The main score is ``ndcg_at_10``.

    Args (and ``name``, ``language``: see the module docstring):
        beir_dir: the folder.
        split: which ``qrels/<split>.tsv`` to evaluate. ``None``: ``test`` if that file
            exists, otherwise the folder's only qrels file (SciFact's local copy has ``train``).
        limit: evaluate at most this many queries, a deterministic sample; every document
            relevant to a kept query stays in the corpus.
        corpus_limit: keep at most this many documents: all documents relevant to the kept
            queries plus a deterministic sample of the others. ``None`` keeps the whole corpus.
    """

    def __init__(
        self,
        beir_dir: str | os.PathLike,
        split: str | None = None,
        name: str | None = None,
        limit: int | None = None,
        corpus_limit: int | None = None,
        language: str = "eng-Latn",
    ) -> None:
        self.beir_dir = Path(beir_dir)
        split = split or _default_split(self.beir_dir)
        self.split = split
        self.limit = _check_limit(limit)
        self.corpus_limit = _check_limit(corpus_limit)
        self.corpus_path, self.queries_path, self.qrels_path = beir_paths(self.beir_dir, split)
        # exists(), not is_file(): a device or FIFO in their place is refused by name when read
        for path in (self.corpus_path, self.queries_path):
            if not path.exists():
                raise FileNotFoundError(f"{path}: not found (a BEIR folder holds corpus.jsonl, queries.jsonl, qrels/)")
        if not self.qrels_path.exists():
            available = sorted(p.stem for p in (self.beir_dir / "qrels").glob("*.tsv"))
            found = ", ".join(available) or "none"
            raise FileNotFoundError(f"{self.qrels_path}: not found; qrels splits in this folder: {found}")
        metadata = _metadata(
            _RETRIEVAL,
            self.beir_dir,
            name,
            language,
            {"split": split, "limit": limit, "corpus_limit": corpus_limit},
            paths=[self.corpus_path, self.queries_path, self.qrels_path],
            where=f"{self.beir_dir} (qrels split {split!r})",
            eval_split=split,
        )
        super().__init__(metadata)

    def _read(self) -> dict:
        folder = read_beir(self.beir_dir, self.split)
        corpus, queries, qrels = folder.corpus, folder.queries, folder.qrels
        # Only queries with at least one relevant document can be scored (mteb drops the rest).
        query_ids = [q for q in queries if any(score > 0 for score in qrels.get(q, {}).values())]
        if not query_ids:
            raise DataFileError(self.qrels_path, 1, "no query has a relevant document (a score > 0)")
        if self.limit is not None:
            chosen = sample_keys(query_ids, self.limit)
            query_ids = [q for q in query_ids if q in chosen]
        qrels = {q: qrels[q] for q in query_ids}
        doc_ids = list(corpus)
        if self.corpus_limit is not None and self.corpus_limit < len(doc_ids):
            relevant = {d for q in query_ids for d in qrels[q]}
            others = [d for d in doc_ids if d not in relevant]
            extra = sample_keys(others, max(0, self.corpus_limit - len(relevant)))
            doc_ids = [d for d in doc_ids if d in relevant or d in extra]
        split_data = {
            "corpus": Dataset.from_dict(
                {
                    "id": doc_ids,
                    "title": [corpus[d].title for d in doc_ids],
                    "text": [corpus[d].text for d in doc_ids],
                }
            ),
            "queries": Dataset.from_dict({"id": query_ids, "text": [queries[q].text for q in query_ids]}),
            "relevant_docs": qrels,
            "top_ranked": None,
        }
        return {"default": {self.split: split_data}}


def sts_task(path: str | os.PathLike, name: str | None = None, limit: int | None = None, **kwargs: Any) -> LocalSTSTask:
    """An mteb STS task over a local ``score sentence1 sentence2`` table. See :class:`LocalSTSTask`."""
    return LocalSTSTask(path, name=name, limit=limit, **kwargs)


def retrieval_task(
    beir_dir: str | os.PathLike,
    split: str | None = None,
    name: str | None = None,
    limit: int | None = None,
    **kwargs: Any,
) -> LocalRetrievalTask:
    """An mteb retrieval task over a local BEIR folder. See :class:`LocalRetrievalTask`."""
    return LocalRetrievalTask(beir_dir, split=split, name=name, limit=limit, **kwargs)


def classification_task(
    path: str | os.PathLike, name: str | None = None, limit: int | None = None, **kwargs: Any
) -> LocalClassificationTask:
    """An mteb classification task over a local ``text,label`` table. See :class:`LocalClassificationTask`."""
    return LocalClassificationTask(path, name=name, limit=limit, **kwargs)


def pair_classification_task(
    path: str | os.PathLike, name: str | None = None, limit: int | None = None, **kwargs: Any
) -> LocalPairClassificationTask:
    """An mteb pair-classification task over a local 0/1-labelled pair table. See
    :class:`LocalPairClassificationTask`."""
    return LocalPairClassificationTask(path, name=name, limit=limit, **kwargs)
