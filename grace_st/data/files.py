"""Reading data files: header-named tables and JSON lines, with errors that name the file and
the 1-based line, plus the deterministic sampling and id splits that training, the local mteb
tasks and the benchmarks share.

A reader given ``on_error=None`` raises :class:`DataFileError` at the first bad row; given a
callable, it hands each :class:`DataFileError` to it and leaves that row out (training's
``bad_rows: skip`` collects them all before the first step).

Every file is read one line at a time, never whole: a data file must be a regular file (a
device, a FIFO or a directory is refused before anything is read: ``/dev/zero`` would never
end) of at most :data:`MAX_FILE_BYTES` (for ``.gz``, what it decompresses to), and a line may
hold at most :data:`MAX_LINE_BYTES`. A line over that limit ends the read (a
:class:`DataFileError` naming the file, the line and the limit; with ``on_error`` the rows
before it are kept); a file over the size limit is a ``ValueError`` naming the file and the
limit. So a binary or runaway file costs at most one line of memory before its error.

The module is the reading contract every format in :mod:`grace_st.data.formats` goes through: the limits, the error
type and the line-by-line readers.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import hashlib
import io
import itertools
import json
import math
import os
import random
import stat
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# Fixed seed of every subsample and generated split: the same file and options give the same rows.
SAMPLING_SEED = 42

# Limits of what a data file may hold (see the module docstring). Far above the datasets grace-st
# reads (SciFact's corpus is 8 MB, its longest line 60 kB); reached only by a file that is not data.
MAX_FILE_BYTES = 1 << 30  # 1 GiB
MAX_LINE_BYTES = 8 << 20  # 8 MiB, the newline included


class DataFileError(ValueError):
    """A malformed data file. The message starts with ``"<path>, line <n>: "``.

    Attributes:
        path: the file, as given.
        line: 1-based line number of the offending line (1 is the header of a table).
    """

    def __init__(self, path: str | os.PathLike, line: int, reason: str) -> None:
        self.path = str(path)
        self.line = line
        self.reason = reason
        super().__init__(f"{self.path}, line {line}: {reason}")


OnError = Callable[[DataFileError], None] | None


def report(error: DataFileError, on_error: OnError) -> None:
    """Raise ``error``, or hand it to ``on_error`` (whose caller then leaves the row out)."""
    if on_error is None:
        raise error
    on_error(error)


def _amount(size: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift} {unit}"
    return f"{size:,} bytes"


_NOT_REGULAR = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISSOCK, "a socket"),
)


def open_regular_file(path: str | os.PathLike, what: str = "data", max_bytes: int | None = None):
    """``path`` opened for binary reading, once the open file is known to be a regular file (of at most
    ``max_bytes``, when given). Checked on the opened descriptor, not the name, and opened without blocking, so a
    FIFO is refused instead of waiting for a writer. ``what`` names the kind of file in the errors."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    descriptor = os.open(path, flags)
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            kind = next((name for test, name in _NOT_REGULAR if test(info.st_mode)), "a special file")
            raise ValueError(f"{path}: {kind}, not a regular file; {what} is read from regular files only")
        if max_bytes is not None and info.st_size > max_bytes:
            raise ValueError(
                f"{path}: {info.st_size:,} bytes, over the {_amount(max_bytes)} limit of a data file "
                "(grace_st.data.files.MAX_FILE_BYTES); split it, or take a sample"
            )
        if flags & getattr(os, "O_NONBLOCK", 0):
            os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def open_data_file(path: str | os.PathLike):
    """``path`` opened for binary reading, once the open file is known to be a regular file of at
    most :data:`MAX_FILE_BYTES` (:func:`open_regular_file`)."""
    return open_regular_file(path, max_bytes=MAX_FILE_BYTES)


def bounded_lines(source: str | os.PathLike, handle, on_error: OnError = None) -> Iterator[tuple[int, bytes]]:
    """``(1-based number, bytes)`` of each line of the binary ``handle``, newline kept, one line in
    memory at a time. A line over :data:`MAX_LINE_BYTES` is reported (raised without ``on_error``)
    and ends the lines; more than :data:`MAX_FILE_BYTES` in all (a ``.gz``'s content, a stream) is
    a ``ValueError``. ``source`` names the file (or ``stdin``) in the errors."""
    total = 0
    for number in itertools.count(1):
        raw = handle.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        if len(raw) > MAX_LINE_BYTES:
            problem = (
                f"a line over {_amount(MAX_LINE_BYTES)} (grace_st.data.files.MAX_LINE_BYTES): "
                "not a text data file, or one without line breaks"
            )
            report(DataFileError(source, number, problem), on_error)
            return
        total += len(raw)
        if total > MAX_FILE_BYTES:
            raise ValueError(
                f"{source}: more than {_amount(MAX_FILE_BYTES)} of data, the limit of a data file "
                "(grace_st.data.files.MAX_FILE_BYTES); split it, or take a sample"
            )
        yield number, raw


@contextlib.contextmanager
def data_lines(path: Path, on_error: OnError = None) -> Iterator[Iterator[tuple[int, bytes]]]:
    """:func:`bounded_lines` of a data file (a ``.gz`` decompressed as it is read)."""
    with open_data_file(path) as raw, gzip.GzipFile(fileobj=raw) if path.suffix == ".gz" else raw as handle:
        yield bounded_lines(path, handle, on_error)


@dataclass(frozen=True)
class Row:
    """One record of a table: its values by header name and the line it starts on."""

    line: int
    values: dict[str, str]

    def __getitem__(self, column: str) -> str:
        return self.values[column]


def decode_utf8(path: Path, data: bytes, line: int = 1) -> str:
    """``data`` (the file from ``line`` on) as text, or a :class:`DataFileError` naming the line
    and byte that are not UTF-8. A leading byte-order mark is dropped, as ``utf-8-sig`` does."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line += data.count(b"\n", 0, error.start)
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
        raise DataFileError(
            path,
            line,
            f"not valid UTF-8: byte {data[error.start]:#04x} at column {column}; "
            "convert the file (e.g. iconv -f latin1 -t utf-8)",
        ) from None
    return text.removeprefix("\ufeff") if line == 1 else text


def _table_lines(path: Path, lines: Iterator[tuple[int, bytes]]) -> Iterator[str]:
    """Decoded lines for :mod:`csv`, split as ``open(path, newline="")`` splits them (a lone
    ``\\r`` ends a line too, endings kept); a line that is not UTF-8 raises :class:`DataFileError`."""
    for number, raw in lines:
        yield from io.StringIO(decode_utf8(path, raw, number), newline="")


def _delimiter(path: Path, header: str) -> str:
    suffix = path.suffix.lower()
    if suffix in (".tsv", ".tab"):
        return "\t"
    if suffix == ".csv":
        return ","
    # Unknown extension (.txt ...): tab, else semicolon (CARER emotion's `text;label_name`), else comma.
    if "\t" in header:
        return "\t"
    return ";" if ";" in header and "," not in header else ","


def read_table(path: str | os.PathLike, on_error: OnError = None) -> tuple[list[str], list[Row]]:
    """Header names and rows of a CSV or TSV file (``.tsv`` / ``.csv``; other extensions are
    read as TSV if the header has a tab, else as ``;``-separated if it has a ``;`` and no comma,
    else as CSV).

    TSV fields are taken literally (quotes are text, as in STS-B and MRPC); CSV follows the
    usual quoting rules, so a quoted field may span lines. Blank lines are skipped. A row with
    a different number of fields than the header is a :class:`DataFileError`; with ``on_error``
    it is left out, and a file that cannot be read past some line (malformed quoting, bytes
    that are not UTF-8, an over-long line) keeps the rows before it.
    """
    path = Path(path)
    header: list[str] = []
    rows: list[Row] = []
    with data_lines(path, on_error) as raw_lines:
        lines = _table_lines(path, raw_lines)
        try:
            first = next(lines, "")
        except DataFileError as error:
            report(error, on_error)
            return header, rows
        if not first.strip():
            report(DataFileError(path, 1, "empty file: expected a header row naming the columns"), on_error)
            return header, rows
        delimiter = _delimiter(path, first)
        quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
        reader = csv.reader(itertools.chain([first], lines), delimiter=delimiter, quoting=quoting, strict=True)
        try:
            header = [name.strip() for name in next(reader)]
            start = reader.line_num + 1
            for fields in reader:
                if fields and any(field.strip() for field in fields):
                    if len(fields) != len(header):
                        problem = f"expected {len(header)} fields ({', '.join(header)}), found {len(fields)}"
                        report(DataFileError(path, start, problem), on_error)
                    else:
                        rows.append(Row(start, dict(zip(header, fields))))
                start = reader.line_num + 1
        except csv.Error as error:
            kind = {"\t": "TSV", ",": "CSV"}.get(delimiter, f"{delimiter!r}-separated file")
            report(DataFileError(path, reader.line_num, f"malformed {kind}: {error}"), on_error)
        except DataFileError as error:  # a line that is not UTF-8
            report(error, on_error)
    duplicates = sorted({name for name in header if header.count(name) > 1})
    if duplicates:
        report(DataFileError(path, 1, f"duplicate column names: {', '.join(duplicates)}"), on_error)
        return header, []
    return header, rows


def find_column(path: Path, header: Sequence[str], role: str, candidates: Sequence[str]) -> str:
    """The first of ``candidates`` present in ``header`` (exact, then case-insensitive)."""
    for name in candidates:
        if name in header:
            return name
    lowered = {name.lower(): name for name in header}
    for name in candidates:
        if name.lower() in lowered:
            return lowered[name.lower()]
    raise DataFileError(
        path,
        1,
        f"missing {role} column: expected one of {', '.join(repr(c) for c in candidates)}; "
        f"the header has {', '.join(repr(c) for c in header)}",
    )


def parse_float(path: Path, row: Row, column: str) -> float:
    text = row[column].strip()
    try:
        value = float(text)
    except ValueError:
        raise DataFileError(path, row.line, f"{column} {text!r} is not a number") from None
    if not math.isfinite(value):
        raise DataFileError(path, row.line, f"{column} {text!r} is not a finite number")
    return value


def parse_int(path: Path, row: Row, column: str, allowed: Iterable[int] | None = None) -> int:
    text = row[column].strip()
    try:
        number = float(text)
    except ValueError:
        number = math.nan
    if not number.is_integer():
        raise DataFileError(path, row.line, f"{column} {text!r} is not an integer")
    value = int(number)
    if allowed is not None and value not in set(allowed):
        raise DataFileError(
            path, row.line, f"{column} {text!r} is not one of {', '.join(str(a) for a in sorted(set(allowed)))}"
        )
    return value


def read_jsonl(
    path: str | os.PathLike, required: Sequence[str] = (), on_error: OnError = None
) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for each non-blank line; each must be a JSON object with ``required`` keys.
    A ``.gz`` file is read through gzip (the shared data ships ``pairs.jsonl.gz``)."""
    path = Path(path)
    with data_lines(path, on_error) as lines:
        for number, raw in lines:
            try:
                item = _json_object(path, number, raw, required)
            except DataFileError as error:
                report(error, on_error)
                continue
            if item is not None:
                yield number, item


def is_jsonl(path: Path) -> bool:
    """JSON lines: ``x.jsonl`` or ``x.jsonl.gz``."""
    return path.name.endswith((".jsonl", ".jsonl.gz"))


def _json_object(path: Path, number: int, raw: bytes, required: Sequence[str]) -> dict | None:
    text = decode_utf8(path, raw, number)
    if not text.strip():
        return None
    try:
        item = json.loads(text)
    except json.JSONDecodeError as error:
        raise DataFileError(
            path, number, f"invalid JSON (malformed JSON at column {error.colno}: {error.msg})"
        ) from None
    if not isinstance(item, dict):
        raise DataFileError(path, number, f"expected a JSON object, found {type(item).__name__}")
    missing = [key for key in required if key not in item]
    if missing:
        raise DataFileError(path, number, f"missing key(s) {', '.join(repr(k) for k in missing)}")
    return item


def sample_keys(keys: Sequence[str], k: int, seed: int = SAMPLING_SEED) -> set[str]:
    """A deterministic sample of ``k`` distinct keys.

    Keys are ranked by a keyed hash, so the sample is the same on every platform and Python
    version, and a key that is sampled from a file stays sampled when rows are appended
    elsewhere.
    """
    if k >= len(keys):
        return set(keys)
    return set(sorted(keys, key=lambda key: _rank(seed, key))[:k])


def sample_indices(count: int, limit: int | None) -> list[int]:
    """Row indices ``0 .. count-1``, or a deterministic sample of ``limit`` of them, in order."""
    if limit is None or limit >= count:
        return list(range(count))
    chosen = sample_keys([str(i) for i in range(count)], limit)
    return [i for i in range(count) if str(i) in chosen]


def shuffled(keys: Sequence[str], seed: int = SAMPLING_SEED) -> list[str]:
    """``keys`` in a deterministic pseudo-random order (the order :func:`sample_keys` draws in)."""
    return sorted(keys, key=lambda key: _rank(seed, key))


SCOREBOARD_SEED = 20260101  # benchmarks/dev_eval.py's fixed samples


def scoreboard_sample(items: Sequence, count: int, salt: str) -> list:
    """The development scoreboard's fixed sample of ``count`` items (all when there are fewer):
    ``benchmarks/dev_eval.py`` draws its STS, MRPC, SciFact and Banking77 sets with it, and
    training calls it to leave exactly those texts out (a labelled source's ``hold_out_scoreboard``)."""
    if len(items) <= count:
        return list(items)
    return random.Random(f"{SCOREBOARD_SEED}:{salt}").sample(list(items), count)


def id_fraction(key: str) -> float:
    """A stable position in [0, 1) for an id: disjoint slices of one split by id hash (training
    keeps SciFact claims in [0, 0.9), the development scoreboard holds back the rest)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") / 2**64


def _rank(seed: int, key: str) -> bytes:
    return hashlib.blake2b(f"{seed}\x00{key}".encode(), digest_size=8).digest()


def fingerprint(paths: Iterable[str | os.PathLike], **options) -> str:
    """Content hash of files plus the options that shape a task: the task's dataset revision.

    mteb keys cached results by dataset revision, so an edited file or a different ``limit``
    never reuses results computed on other data.
    """
    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).name.encode() + b"\x00")
        with open_data_file(path) as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\x00")
    digest.update(json.dumps(options, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]
