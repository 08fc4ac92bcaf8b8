"""``grace-st encode-corpus``: every text of a corpus embedded once, on Ray Data, resumable.

The pipeline is Ray Data's own: a file datasource reads the JSONL or Parquet files in streaming blocks,
``map_batches`` hands the blocks to a pool of actors that each load the model once and call its own
``encode_document`` (``encode_query``, ``encode``), and ``write_parquet`` writes one Parquet shard a block.
The same code runs on a local Ray started inside the call and on a cluster joined by address. Every row
carries its id: Ray Data keeps no order and the output needs none.

What carries "every id exactly once" (docs/corpus.md):

* within a run, Ray: an actor lost with its process or node is restarted (``max_restarts=-1``) and the
  batch it held retried (``max_task_retries=-1``); a block lost with a node is rebuilt from lineage; a
  retried write task writes the same file name again;
* across runs, this module: a shard is complete when its Parquet footer reads (pyarrow writes the footer
  last), an incomplete one is removed, and the ids of the complete ones are left out of the new run's
  input (:func:`encode_corpus` reads them before anything else). A run on a complete output loads no model.
  At the end every shard's ids are read back and checked against the input: none missing, none twice.

Bad input is found before any model work: the driver reads every row once with the same reader the
pipeline uses (:func:`_file_rows`) and checks ids and texts (:func:`_row_problem`), and the length of each
text in tokens with the model's tokenizer and prompt template (:func:`_long_rows`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from grace_st.default_model import default_model_path
from grace_st.prompts import build_template, text_problem

# Parquet schema metadata key of a shard: JSON of :func:`identity` plus the model's name and grace-st's version.
METADATA_KEY = b"grace_st"
PROMPT_TYPES = ("document", "query", "default")
DTYPES = ("float32", "float16", "int8")
BAD_ROW_POLICIES = ("fail", "skip")
JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
SKIPPED_REPORT = "_skipped_rows.jsonl"  # inside OUTPUT; readers of a Parquet folder pass over "_" files
# Problems listed in a "fail" error at most (the report file of --on-bad-row skip lists them all).
SHOWN_PROBLEMS = 10
# A JSONL line longer than this stops the check, naming the line, instead of filling memory.
MAX_LINE_BYTES = 64 * 1024 * 1024
INT64 = (-(2**63), 2**63 - 1)


class CorpusError(ValueError):
    """The corpus, the output folder or the options cannot give a correct output; the message names the file,
    the row and the way out."""


# -- input ------------------------------------------------------------------------------------------------------


def _filesystem(path: str):
    """A pyarrow filesystem and the path inside it: a URI (``s3://``, ``gs://``) or a local path."""
    import pyarrow.fs as pafs

    if "://" in path:
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), os.path.abspath(path)


def _format(path: str) -> str | None:
    name = path.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


def corpus_files(path: str) -> tuple[Any, list[str]]:
    """The filesystem and the corpus files of ``path``: the file itself, or the ``.jsonl``/``.json``/``.parquet``
    files under a folder in path order (names starting with ``.`` or ``_`` are passed over, as Parquet
    readers do)."""
    import pyarrow.fs as pafs

    fs, root = _filesystem(path)
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise CorpusError(f"{path}: no such file or folder")
    if info.type == pafs.FileType.File:
        if _format(root) is None:
            raise CorpusError(f"{path}: not a corpus file; give a .jsonl, .json (JSON Lines) or .parquet file")
        return fs, [root]
    found = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    files = sorted(
        entry.path
        for entry in found
        if entry.type == pafs.FileType.File
        and _format(entry.path) is not None
        and not any(part.startswith((".", "_")) for part in os.path.relpath(entry.path, root).split(os.sep))
    )
    if not files:
        raise CorpusError(f"{path}: a folder with no .jsonl, .json or .parquet file")
    return fs, files


@dataclass(frozen=True)
class Columns:
    """Which columns hold the id and the text, and whether ids are made (each row's number in the corpus)."""

    text: str = "text"
    id: str = "id"
    make_ids: bool = False


@dataclass
class Row:
    number: int  # the JSONL line (1-based) or the Parquet row (1-based)
    id: Any
    text: Any
    problem: str | None = None
    index: int = 0  # the row's place among its file's rows (0-based): a made id is the file's offset plus it


def _where(path: str, row: Row, fmt: str) -> str:
    return f"{path} {'line' if fmt == 'jsonl' else 'row'} {row.number}"


def _id_problem(value: Any) -> str | None:
    if value is None:
        return "the id is null"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return f"the id is {type(value).__name__} ({value!r:.40}); ids are strings or integers"
    if isinstance(value, int) and not INT64[0] <= value <= INT64[1]:
        return f"the id {value} does not fit in 64 bits"
    if isinstance(value, str) and (text_problem(value) is not None or not value):
        return "the id is an empty or invalid string"
    return None


def _text_problem(value: Any, column: str) -> str | None:
    if value is None:
        return f"{column!r} is null"
    problem = text_problem(value)
    if problem is not None:
        return f"{column!r} {problem}"
    if not value.strip():
        return f"{column!r} is empty" if not value else f"{column!r} is only whitespace"
    return None


def _row_problem(row: Row, columns: Columns) -> str | None:
    """Why a row cannot be embedded as given (its id, then its text), or None."""
    if row.problem is not None:
        return row.problem
    if not columns.make_ids:
        problem = _id_problem(row.id)
        if problem is not None:
            return problem
    return _text_problem(row.text, columns.text)


def _jsonl_lines(stream) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each line, a chunk at a time: a file of any size in bounded memory."""
    number, pending = 0, b""
    while True:
        chunk = stream.read(1 << 20)
        if not chunk:
            break
        pending += chunk
        lines = pending.split(b"\n")
        pending = lines.pop()
        if len(pending) > MAX_LINE_BYTES:
            raise CorpusError(f"line {number + len(lines) + 1} is over {MAX_LINE_BYTES >> 20} MiB")
        for line in lines:
            number += 1
            yield number, line
    if pending:
        yield number + 1, pending


def _jsonl_row(number: int, raw: bytes, columns: Columns) -> Row | None:
    raw = raw.removesuffix(b"\r")
    if number == 1:
        raw = raw.removeprefix(b"\xef\xbb\xbf")
    if not raw.strip():
        return None  # a blank line is no row (a file's last newline, a spacer)
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return Row(number, None, None, f"not valid UTF-8 (byte {raw[error.start]:#04x} at column {error.start + 1})")
    try:
        value = json.loads(line)
    except json.JSONDecodeError as error:
        return Row(number, None, None, f"not valid JSON ({error.msg} at column {error.colno})")
    if not isinstance(value, dict):
        return Row(number, None, None, f"a JSON {type(value).__name__}, not an object")
    row = Row(number, value.get(columns.id), value.get(columns.text))
    if not columns.make_ids and columns.id not in value:
        row.problem = f"no {columns.id!r} field"
    elif columns.text not in value:
        row.problem = f"no {columns.text!r} field"
    return row


def _parquet_batches(handle, path: str, columns: Columns, batch_rows: int) -> Iterator[list[Row]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(handle)
    except (pa.ArrowException, OSError) as error:
        raise CorpusError(f"{path}: not a readable Parquet file ({error})") from None
    names = reader.schema_arrow.names
    wanted = [columns.text] if columns.make_ids else [columns.id, columns.text]
    for name, what in zip(wanted[::-1], ("text", "id")):
        if name not in names:
            option = "--text-column" if what == "text" else "--id-column (or --make-ids to number the rows)"
            raise CorpusError(f"{path}: no column {name!r} (its columns: {', '.join(names)}); name it with {option}")
    text_type = reader.schema_arrow.field(columns.text).type
    if not (pa.types.is_string(text_type) or pa.types.is_large_string(text_type)):
        raise CorpusError(f"{path}: column {columns.text!r} is {text_type}, not text (string)")
    number = 0
    for batch in reader.iter_batches(batch_size=batch_rows, columns=wanted):
        texts = _strings(batch.column(columns.text))
        ids = [None] * len(texts) if columns.make_ids else _strings(batch.column(columns.id))
        rows = []
        for value_id, text in zip(ids, texts):
            number += 1
            if isinstance(value_id, _Invalid):
                rows.append(Row(number, None, None, f"the id is {value_id.message}"))
            elif isinstance(text, _Invalid):
                rows.append(Row(number, value_id, None, f"{columns.text!r} is {text.message}"))
            else:
                rows.append(Row(number, value_id, text))
        yield rows


@dataclass(frozen=True)
class _Invalid:
    message: str


def _strings(array) -> list:
    """A column's values; a string whose bytes are not UTF-8 (Parquet does not check) as an :class:`_Invalid`
    naming the byte, instead of an error for the whole batch."""
    import pyarrow as pa

    if not (pa.types.is_string(array.type) or pa.types.is_large_string(array.type)):
        return array.to_pylist()
    try:
        array.validate(full=True)
        return array.to_pylist()
    except pa.ArrowInvalid:
        values = []
        for raw in array.cast(pa.large_binary()).to_pylist():
            try:
                values.append(None if raw is None else raw.decode("utf-8"))
            except UnicodeDecodeError as error:
                values.append(_Invalid(f"not valid UTF-8 (byte {raw[error.start]:#04x} at byte {error.start + 1})"))
        return values


def _file_rows(fs, path: str, columns: Columns, batch_rows: int = 1024, cap: int | None = None) -> Iterator[list[Row]]:
    """The rows of one corpus file in batches, in file order, at most ``cap``: one reader for the driver's
    checks and the pipeline, so both see the same rows with the same numbers."""
    fmt = _format(path)
    seen = 0
    if fmt == "parquet":
        with fs.open_input_file(path) as handle:
            for rows in _parquet_batches(handle, path, columns, batch_rows):
                rows = rows[: cap - seen] if cap is not None else rows
                for row in rows:
                    row.index, seen = seen, seen + 1
                if rows:
                    yield rows
                if cap is not None and seen >= cap:
                    return
        return
    with fs.open_input_stream(path) as stream:
        rows = []
        try:
            for number, raw in _jsonl_lines(stream):
                if cap is not None and seen >= cap:
                    break
                row = _jsonl_row(number, raw, columns)
                if row is None:
                    continue
                row.index, seen = seen, seen + 1
                rows.append(row)
                if len(rows) >= batch_rows:
                    yield rows
                    rows = []
        except CorpusError as error:
            raise CorpusError(f"{path}: {error}") from None
        if rows:
            yield rows


# -- the model's identity ----------------------------------------------------------------------------------


def identity(
    settings: Mapping[str, Any], prompt_type: str, dtype: str, rationale: bool, id_column: str
) -> dict[str, Any]:
    """Everything that decides a shard's embeddings besides the text: the weights' revision and each
    setting as texts of ``prompt_type`` get it (its instruction, its rationale budget), the stored dtype and
    whether rationales are stored. Shards of one output must share it."""
    from grace_st.settings import SETTINGS, for_prompt_type

    instructions = settings["instructions"]
    found = {
        "id_column": id_column,
        "prompt_type": prompt_type,
        "instruction": instructions.get(prompt_type, instructions["default"]),
        "dtype": dtype,
        "rationale": rationale,
    }
    for name in SETTINGS:
        if name != "instructions":
            value = settings[name]
            found[name] = for_prompt_type(value, prompt_type) if isinstance(value, Mapping) else value
    return json.loads(json.dumps(found))  # as a shard's metadata reads back


def saved_settings(model: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A GRACE model's settings as loading it with ``overrides`` gives them, read from its ``grace_config.json``
    alone (no weights): the driver's view of the identity the actors will have."""
    from grace_st.encoder import GenerativeEncoder
    from grace_st.settings import DEFAULTS, check_settings, default_budget, overridden

    try:
        config = GenerativeEncoder.load_config(model)
    except FileNotFoundError as error:
        raise CorpusError(f"--model {model}: not a GRACE model ({error})") from None
    settings = {**DEFAULTS, **config}
    settings["instructions"] = {**DEFAULTS["instructions"], **config.get("instructions", {})}
    if config.get("max_rationale_tokens") is None:
        settings["max_rationale_tokens"] = default_budget(settings["method"])
    settings.update(overridden(settings, overrides))
    check_settings(settings)
    return settings


# -- output -------------------------------------------------------------------------------------------------


@dataclass
class Output:
    """What an output folder holds: its complete shards' ids and identity, and the incomplete shards found."""

    fs: Any
    root: str
    shards: list[str] = field(default_factory=list)
    ids: list = field(default_factory=list)
    identities: dict[str, dict] = field(default_factory=dict)  # shard -> its metadata
    incomplete: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)


def read_output(path: str) -> Output:
    """The shards of an output folder: each one's ids (its metadata names the id column) and metadata, the ones
    whose footer does not read (a write cut short) apart, and Parquet files encode-corpus did not write apart."""
    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    fs, root = _filesystem(path)
    output = Output(fs, root)
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        return output
    if info.type != pafs.FileType.Directory:
        raise CorpusError(f"OUTPUT {path} is a file; give a folder (it holds Parquet shards)")
    entries = fs.get_file_info(pafs.FileSelector(root, recursive=False))
    for entry in sorted(entries, key=lambda e: e.path):
        name = os.path.basename(entry.path)
        if entry.type != pafs.FileType.File or not name.endswith(".parquet") or name.startswith((".", "_")):
            continue
        try:
            with fs.open_input_file(entry.path) as handle:
                reader = pq.ParquetFile(handle)
                metadata = (reader.schema_arrow.metadata or {}).get(METADATA_KEY)
                id_column = json.loads(metadata).get("id_column") if metadata is not None else None
                if id_column not in reader.schema_arrow.names:
                    output.foreign.append(entry.path)
                    continue
                ids = reader.read(columns=[id_column]).column(id_column).to_pylist()
        except (pa.ArrowException, OSError):
            output.incomplete.append(entry.path)
            continue
        output.shards.append(entry.path)
        output.identities[entry.path] = json.loads(metadata)
        output.ids.extend(ids)
    return output


def _mismatch(found: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    keys = sorted(set(found) | set(wanted))
    return [
        f"{key}: {found.get(key)!r} there, {wanted.get(key)!r} now" for key in keys if found.get(key) != wanted.get(key)
    ]


# -- the actor ---------------------------------------------------------------------------------------------


def _long_rows(tokenizer, template, texts: Sequence[str], max_input_tokens: int) -> list[tuple[int, int]]:
    """(index, prompt tokens) of each text whose prompt, the instruction and template around it, is longer
    than ``max_input_tokens`` (where ``encode`` would cut the text)."""
    rows = template.rows(tokenizer, list(texts), sys.maxsize)
    return [(index, len(row)) for index, row in enumerate(rows) if len(row) > max_input_tokens]


class CorpusEncoder:
    """A Ray Data actor: loads the model once and embeds each batch with the model's own ``encode_document``
    (``encode_query``, ``encode``), so a text's embedding is the one that call gives in process. Checks, once
    loaded, that the model is the one the driver named in the output's metadata."""

    def __init__(self, model: str | None, overrides: dict, prompt_type: str, dtype: str, rationale: bool,
                 threads: int, device: str | None, trust_remote_code: bool, truncate: bool, expected: dict, name: str):
        import torch

        from grace_st.files.loading import load
        from grace_st.settings import SETTINGS

        torch.set_num_threads(threads)
        # The embedded default is built on each node from the installed package (its own cache folder there).
        model = model or default_model_path()
        self.model = load(model, device=device, trust_remote_code=trust_remote_code)
        encoder = self.encoder = self.model[0]
        if not hasattr(encoder, "override_settings"):
            raise CorpusError(f"{model} is not a GRACE model")
        encoder.override_settings(overrides)
        self.identity = identity(
            {key: getattr(encoder, key) for key in SETTINGS}, prompt_type, dtype, rationale, expected["id_column"]
        )
        problems = _mismatch(self.identity, expected)
        if problems:
            raise CorpusError(f"the model loaded on this worker is not the one the driver read: {'; '.join(problems)}")
        self.prompt_type, self.dtype, self.rationale, self.truncate = prompt_type, dtype, rationale, truncate
        self.template = encoder.prompt_template(self.identity["instruction"])
        version = sys.modules[__package__].__version__  # the loaded package's: it imports this module, not the reverse
        self.metadata = json.dumps({**self.identity, "model": name, "grace_st_version": version}).encode()
        self.dimension = encoder.get_embedding_dimension()

    def _encode(self, texts: list[str], **kwargs):
        if self.prompt_type == "document":
            return self.model.encode_document(texts, **kwargs)
        if self.prompt_type == "query":
            return self.model.encode_query(texts, **kwargs)
        return self.model.encode(texts, **kwargs)

    def __call__(self, batch):
        import numpy as np
        import pyarrow as pa

        texts = batch.column("text").to_pylist()
        if not self.truncate:
            long = _long_rows(self.encoder.tokenizer, self.template, texts, self.encoder.max_input_tokens)
            if long:  # the driver's check let them through: a disagreement, never a silently cut text
                index, tokens = long[0]
                raise CorpusError(
                    f"id {batch.column('id')[index].as_py()!r}: {tokens} prompt tokens, over max_input_tokens "
                    f"{self.encoder.max_input_tokens}, which the check before the run did not find"
                )
        columns = {self.identity["id_column"]: batch.column("id")}
        if self.rationale:
            items = self._encode(texts, output_value=None, batch_size=len(texts), show_progress_bar=False)
            vectors = np.stack([item["sentence_embedding"].float().cpu().numpy() for item in items])
            columns["rationale"] = pa.array(
                [self.encoder.decode_rationales(item["rationale_token_ids"])[0] for item in items], pa.string()
            )
        else:
            vectors = self._encode(texts, batch_size=len(texts), convert_to_numpy=True, show_progress_bar=False)
        columns.update(store(np.asarray(vectors, dtype=np.float32), self.dtype))
        table = pa.table(columns)
        return table.replace_schema_metadata({METADATA_KEY: self.metadata})


def store(vectors, dtype: str) -> dict[str, Any]:
    """The embedding column(s) for float32 vectors: a fixed-size list of ``dtype``; for ``int8`` the symmetric
    per-vector quantization ``q = round(v / scale)``, ``scale = max|v| / 127``, beside an ``embedding_scale``
    column (``v ≈ q × scale``)."""
    import numpy as np
    import pyarrow as pa

    dimension = vectors.shape[1]
    if dtype == "int8":
        scale = np.abs(vectors).max(axis=1) / 127
        safe = np.where(scale > 0, scale, 1).astype(np.float32)
        quantized = np.clip(np.rint(vectors / safe[:, None]), -127, 127).astype(np.int8)
        return {
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(quantized.reshape(-1)), dimension),
            "embedding_scale": pa.array(scale.astype(np.float32)),
        }
    values = vectors.astype(np.float16 if dtype == "float16" else np.float32).reshape(-1)
    return {"embedding": pa.FixedSizeListArray.from_arrays(pa.array(values), dimension)}


# -- the datasource -----------------------------------------------------------------------------------------


def _datasource(fs, files: list[str], columns: Columns, caps: dict, offsets: dict, id_type: str, excluded_ref,
                block_rows: int):
    """A Ray Data file datasource over the corpus files: the rows :func:`_file_rows` reads, less the bad ones
    (found again by the same checks, or by id: a text over the length limit), the ones over ``--limit`` and
    the ids already in OUTPUT."""
    from ray.data.datasource import FileBasedDatasource

    class CorpusDatasource(FileBasedDatasource):
        def _read_stream(self, f, path: str):
            import pyarrow as pa
            import ray

            excluded = _excluded_ids(excluded_ref, ray)
            ids, texts = [], []
            for rows in _file_rows(fs, path, columns, block_rows, caps.get(path)):
                for row in rows:
                    if columns.make_ids:
                        row.id = offsets[path] + row.index
                    if _row_problem(row, columns) or _wrong_id_type(row.id, id_type) or row.id in excluded:
                        continue
                    ids.append(row.id)
                    texts.append(row.text)
                    if len(ids) >= block_rows:
                        yield _block(ids, texts, id_type, pa)
                        ids, texts = [], []
            if ids:
                yield _block(ids, texts, id_type, pa)

    return CorpusDatasource(files, filesystem=fs)


_EXCLUDED: dict[str, frozenset] = {}  # one set a worker process, not one a file


def _excluded_ids(ref, ray) -> frozenset:
    key = ref.hex()
    if key not in _EXCLUDED:
        _EXCLUDED.clear()
        _EXCLUDED[key] = frozenset(ray.get(ref))
    return _EXCLUDED[key]


def _block(ids: list, texts: list, id_type: str, pa):
    return pa.table({"id": pa.array(ids, pa.int64() if id_type == "int" else pa.string()), "text": pa.array(texts)})


def _wrong_id_type(value, id_type: str) -> bool:
    return (id_type == "int") != isinstance(value, int)


# -- the driver ---------------------------------------------------------------------------------------------


@dataclass
class Checked:
    """The driver's pass over the input: every good row's id, the rows set aside, each file's rows and the
    made ids' offset of each file."""

    ids: list = field(default_factory=list)
    bad: list[dict] = field(default_factory=list)  # each: file, line or row, id (when it has one), problem
    caps: dict[str, int] = field(default_factory=dict)
    offsets: dict[str, int] = field(default_factory=dict)
    id_type: str | None = None

    @property
    def bad_ids(self) -> list:
        return [bad["id"] for bad in self.bad if "id" in bad]


def check_input(
    fs, files: list[str], columns: Columns, limit: int | None = None, length_check=None, max_input_tokens: int = 0
) -> Checked:
    """Read every row (the first ``limit``) once, as the pipeline will: each bad row with its file, line and
    problem; ids of one type, each once (a repeated id is an error at once); each text within the model's
    input limit (``length_check(texts) -> [(index, prompt tokens)]`` of those over ``max_input_tokens``)."""
    checked = Checked()
    first_of: dict[Any, str] = {}
    total = 0
    for path in files:
        fmt = _format(path)
        checked.offsets[path] = total
        cap = None if limit is None else limit - total
        if cap is not None and cap <= 0:
            checked.caps[path] = 0
            continue
        in_file, lacking = 0, {columns.id: 0, columns.text: 0}
        for rows in _file_rows(fs, path, columns, cap=cap):
            good = []
            for row in rows:
                in_file += 1
                if columns.make_ids:
                    row.id = total + row.index
                for name in lacking:
                    lacking[name] += row.problem == f"no {name!r} field"
                problem = _row_problem(row, columns)
                if row.id is not None and _id_problem(row.id) is None:
                    if row.id in first_of:
                        raise CorpusError(
                            f"{_where(path, row, fmt)}: id {row.id!r} again (first at {first_of[row.id]}); ids must "
                            "be unique: each one names one row of the output"
                        )
                    first_of[row.id] = _where(path, row, fmt)
                    checked.id_type = checked.id_type or ("int" if isinstance(row.id, int) else "str")
                    if problem is None and _wrong_id_type(row.id, checked.id_type):
                        problem = (
                            f"the id is {'an integer' if isinstance(row.id, int) else 'a string'}; earlier ids are "
                            f"{'integers' if checked.id_type == 'int' else 'strings'} (one type for every id)"
                        )
                if problem is not None:
                    checked.bad.append(_bad(path, fmt, row, problem))
                else:
                    good.append(row)
            if length_check is not None and good:
                for index, tokens in length_check([row.text for row in good]):
                    checked.bad.append(_bad(path, fmt, good[index], f"{tokens} prompt tokens with the instruction "
                                            f"and template, over the model's max_input_tokens {max_input_tokens}"))
                    good[index] = None
            checked.ids.extend(row.id for row in good if row is not None)
        for name, count in lacking.items():
            if in_file and count == in_file:
                option = "--text-column" if name == columns.text else "--id-column (or --make-ids to number the rows)"
                raise CorpusError(f"{path}: no row has a {name!r} field; name the column with {option}")
        checked.caps[path] = in_file
        total += in_file
    return checked


def _bad(path: str, fmt: str, row: Row, problem: str) -> dict:
    entry = {"file": path, ("line" if fmt == "jsonl" else "row"): row.number, "problem": problem}
    if row.id is not None and _id_problem(row.id) is None:
        entry["id"] = row.id
    return entry


def _describe(bad: dict) -> str:
    where = f"{bad['file']} {'line ' + str(bad['line']) if 'line' in bad else 'row ' + str(bad['row'])}"
    return f"{where}{' (id ' + repr(bad['id']) + ')' if 'id' in bad else ''}: {bad['problem']}"


def encode_corpus(
    input: str, output: str, *, model: str | None = None, text_column: str = "text", id_column: str = "id",
    make_ids: bool = False, prompt_type: str = "document", batch_size: int = 16, actors: int = 1,
    threads_per_actor: int | None = None, gpus_per_actor: float = 0, address: str | None = None,
    limit: int | None = None, on_bad_row: str = "fail", bad_row_report: str | None = None, truncate: bool = False,
    dtype: str = "float32", rationale: bool = False, overwrite: bool = False, rows_per_shard: int = 256,
    settings: Mapping[str, Any] | None = None, device: str | None = None, trust_remote_code: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Embed every row of a JSONL or Parquet corpus (a file or a folder of files) into Parquet shards under
    ``output``: the id column, ``embedding`` (a fixed-size list of ``dtype``; int8 with ``embedding_scale``) and
    with ``rationale=True`` the rationale pooled; each shard's schema metadata names the model, its
    ``weights_revision``, the prompt type, the budgets and the dtype (``grace_st`` key, JSON).

    Runs on Ray Data (a local Ray started for the call, the cluster at ``address``, or the Ray this process
    joined): ``actors`` actors, each holding the model with ``threads_per_actor`` CPUs and ``gpus_per_actor``
    GPUs, embed ``batch_size`` texts a call with the model's own ``encode_document`` (``encode_query``,
    ``encode`` for those prompt types): each embedding is that call's in one process, bit for bit. Resumable:
    ids in complete shards of ``output`` are not encoded again; an output written with another model, revision,
    prompt type, settings or dtype is refused unless ``overwrite``. Bad rows fail before any model work, or with
    ``on_bad_row="skip"`` are left out and listed in ``bad_row_report``; a duplicate id always fails.
    ``settings`` are encoder settings over the model's (``{"max_rationale_tokens": {"document": 8}}``).
    docs/corpus.md has the whole contract. Returns the run's summary (texts encoded, already done, skipped,
    seconds, texts a second, actors, output)."""
    started = time.perf_counter()
    try:
        import ray.data  # noqa: F401  (whether it is installed, before any work)
    except ImportError as error:
        raise CorpusError(f"encode-corpus needs Ray Data ({error}): pip install 'grace-st[distributed]'") from None
    _check_options(prompt_type, dtype, on_bad_row, actors, batch_size, limit, rows_per_shard, gpus_per_actor,
                   threads_per_actor)
    path = model or default_model_path()
    overrides = dict(settings or {})
    expected = identity(saved_settings(path, overrides), prompt_type, dtype, rationale, id_column)
    fs, files = corpus_files(input)
    columns = Columns(text_column, id_column, make_ids)
    checked, done, summary = _check_before_work(
        input, output, fs, files, columns, expected, path, limit=limit, truncate=truncate, overwrite=overwrite,
        on_bad_row=on_bad_row, bad_row_report=bad_row_report, trust_remote_code=trust_remote_code,
    )
    if summary["encoded"]:
        encoder_kwargs = {
            "model": model, "overrides": overrides, "prompt_type": prompt_type, "dtype": dtype, "rationale": rationale,
            "device": device, "trust_remote_code": trust_remote_code, "truncate": truncate, "expected": expected,
            "name": model or "grace-st-default",
        }
        summary.update(_run(
            fs, files, columns, checked, done | set(checked.bad_ids), output, encoder_kwargs=encoder_kwargs,
            batch_size=batch_size, actors=actors, threads=threads_per_actor, gpus=gpus_per_actor, address=address,
            rows_per_shard=rows_per_shard, progress=progress,
        ))
    final = read_output(output)
    _check_complete(final, set(checked.ids), output)
    summary["seconds"] = round(time.perf_counter() - started, 2)
    summary["texts_per_second"] = round(summary["encoded"] / summary["seconds"], 3) if summary["encoded"] else 0.0
    summary["output_rows"] = len(final.ids)
    return summary


def _check_before_work(input, output, fs, files, columns, expected, path, *, limit, truncate, overwrite, on_bad_row,
                       bad_row_report, trust_remote_code):
    """Everything checked before a model loads: the output's identity, every input row (bad rows refused or
    reported); then the output cleared of what a rerun replaces. Returns the checked input, the ids already done
    and the summary so far."""
    out = read_output(output)
    if not overwrite:
        _check_output(out, output, expected)
    length_check = None if truncate else _length_check(path, expected, trust_remote_code)
    checking = time.perf_counter()
    checked = check_input(fs, files, columns, limit, length_check, expected["max_input_tokens"])
    check_seconds = time.perf_counter() - checking
    report = bad_row_report or os.path.join(output, SKIPPED_REPORT)
    if checked.bad and on_bad_row == "fail":
        shown = "\n  ".join(_describe(bad) for bad in checked.bad[:SHOWN_PROBLEMS])
        more = f"\n  ... and {len(checked.bad) - SHOWN_PROBLEMS} more" if len(checked.bad) > SHOWN_PROBLEMS else ""
        raise CorpusError(
            f"{len(checked.bad)} bad row{'s' if len(checked.bad) > 1 else ''} in {input} (nothing was encoded):\n  "
            f"{shown}{more}\nfix them, or pass --on-bad-row skip to leave them out (listed in {report})"
        )
    if overwrite:
        for shard in out.shards + out.incomplete + out.foreign:
            out.fs.delete_file(shard)
        out = read_output(output)
    for shard in out.incomplete:  # a write cut short: its rows are encoded again
        out.fs.delete_file(shard)
    _write_report(report, checked.bad)
    wanted, present = set(checked.ids), set(out.ids)
    done = wanted & present
    summary = {
        "input_rows": len(checked.ids) + len(checked.bad), "encoded": len(wanted) - len(done),
        "already_done": len(done), "skipped": len(checked.bad), "bad_row_report": report if checked.bad else None,
        "incomplete_shards_removed": len(out.incomplete), "ids_in_output_not_in_input": len(present - wanted),
        "actors": 0, "output": output, "check_seconds": round(check_seconds, 2),
    }
    return checked, done, summary


def _check_options(prompt_type, dtype, on_bad_row, actors, batch_size, limit, rows_per_shard, gpus, threads) -> None:
    for value, allowed, what in ((prompt_type, PROMPT_TYPES, "prompt_type"), (dtype, DTYPES, "dtype"),
                                 (on_bad_row, BAD_ROW_POLICIES, "on_bad_row")):
        if value not in allowed:
            raise CorpusError(f"{what} must be one of {', '.join(allowed)}, got {value!r}")
    for value, what in ((actors, "actors"), (batch_size, "batch_size"), (rows_per_shard, "rows_per_shard")):
        if not isinstance(value, int) or value < 1:
            raise CorpusError(f"{what} must be an integer of at least 1, got {value!r}")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise CorpusError(f"limit must be an integer of at least 1, got {limit!r}")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise CorpusError(f"threads_per_actor must be an integer of at least 1, got {threads!r}")
    if not (isinstance(gpus, (int, float)) and math.isfinite(gpus) and gpus >= 0):
        raise CorpusError(f"gpus_per_actor must be a number >= 0, got {gpus!r}")


def _check_output(out: Output, output: str, expected: dict) -> None:
    if out.foreign:
        raise CorpusError(
            f"OUTPUT {output} holds Parquet files encode-corpus did not write ({os.path.basename(out.foreign[0])}"
            f"{' and more' if len(out.foreign) > 1 else ''}); give another folder, or --overwrite to replace them"
        )
    for shard, found in out.identities.items():
        problems = _mismatch({key: found.get(key) for key in expected}, expected)
        if problems:
            raise CorpusError(
                f"OUTPUT {output} was written with another model or settings ({os.path.basename(shard)}: "
                f"{'; '.join(problems)}); give another folder, or --overwrite to replace it"
            )


def _length_check(model: str, expected: dict, trust_remote_code: bool):
    """``texts -> [(index, prompt tokens)]`` over the model's limit, with its tokenizer and template only."""
    from transformers import AutoTokenizer

    from grace_st.files.model_files import tokenizer_source

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source(model), trust_remote_code=trust_remote_code)
    template = build_template(tokenizer, expected["prompt_format"], expected["instruction"])
    return lambda texts: _long_rows(tokenizer, template, texts, expected["max_input_tokens"])


def _write_report(path: str, bad: list[dict]) -> None:
    fs, target = _filesystem(path)
    if not bad:
        if fs.get_file_info(target).is_file:
            fs.delete_file(target)
        return
    fs.create_dir(os.path.dirname(target), recursive=True)
    with fs.open_output_stream(target) as stream:
        for entry in bad:
            stream.write((json.dumps(entry, ensure_ascii=False) + "\n").encode())


def _check_complete(final: Output, wanted: set, output: str) -> None:
    seen, twice = set(), set()
    for value in final.ids:
        (twice if value in seen else seen).add(value)
    missing = wanted - seen
    if twice or missing or final.incomplete:
        raise CorpusError(
            f"OUTPUT {output} after the run: {len(missing)} ids missing, {len(twice)} written twice "
            f"({sorted(twice, key=str)[:5]}), {len(final.incomplete)} incomplete shards; run the command again "
            "to finish it"
        )


def _run(fs, files, columns, checked, excluded, output, *, encoder_kwargs, batch_size, actors, threads, gpus,
         address, rows_per_shard, progress) -> dict:
    """The Ray Data pipeline: read (less ``excluded`` ids) → ``map_batches`` over a pool of
    :class:`CorpusEncoder` actors → ``write_parquet``."""
    import ray
    import ray.data

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, include_dashboard=False, logging_level="WARNING")
    try:
        ray.data.DataContext.get_current().enable_progress_bars = progress
        threads = threads or _default_threads(ray, actors)
        source = _datasource(fs, files, columns, checked.caps, checked.offsets, checked.id_type or "str",
                             ray.put(list(excluded)), rows_per_shard)
        device = encoder_kwargs["device"] or ("cuda" if gpus else None)
        started = time.perf_counter()
        # Reads and writes take no whole CPU: an actor given every CPU of a node must not starve them.
        pipeline = ray.data.read_datasource(source, num_cpus=0).map_batches(
            CorpusEncoder,
            fn_constructor_kwargs={**encoder_kwargs, "device": device, "threads": threads},
            compute=ray.data.ActorPoolStrategy(size=actors),
            batch_size=batch_size,
            batch_format="pyarrow",
            num_cpus=threads,
            num_gpus=gpus or None,
        )
        try:
            pipeline.write_parquet(output, ray_remote_args={"num_cpus": 0})
        except Exception as error:  # Ray's errors carry the worker's whole traceback: its last line says why
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            raise CorpusError(
                f"the run stopped ({type(error).__name__}: {lines[-1] if lines else 'no message'}); the shards "
                "written so far are kept: once the cause is fixed, the same command writes the rest "
                "(GRACE_ST_DEBUG=1 shows Ray's traceback)"
            ) from error
        seconds = time.perf_counter() - started
    finally:
        if started_here:
            ray.shutdown()
    return {"actors": actors, "threads_per_actor": threads, "gpus_per_actor": gpus,
            "pipeline_seconds": round(seconds, 2)}


def _default_threads(ray, actors: int) -> int:
    """CPUs an actor: the cluster's CPUs shared among the actors, no more than the largest node has."""
    nodes = [node.get("Resources", {}).get("CPU", 0) for node in ray.nodes() if node.get("Alive")]
    total = sum(nodes) or 1
    return max(1, min(int(total // actors), int(max(nodes or [1]))))
