"""A persistent rationale cache: one SQLite file, shared safely by several processes.

Generation dominates encode latency (method.md §1), and under deterministic decoding the
rationale of a text is a function of the weights, the instruction, the text and the
generation settings. :class:`RationaleCache` stores, per :func:`entry_key` of those, the
rationale token ids (Eq. 1), whether each hit the length limit (Eq. 28), and optionally the
pooled embedding (Eq. 3): a hit skips generation, and with the embedding the forward pass too.

The file is never trusted blindly: a file that is not SQLite, a SQLite database that is not
ours, another format version, a failing ``PRAGMA quick_check`` or a row that does not decode
raises :class:`CacheError`. Nothing is ever overwritten to "repair" it.

Only stdlib ``sqlite3`` and numpy. A key covers the weights through their fingerprint
(:func:`grace_st.runtime.weights.weights_fingerprint`).

The cache is storage only: :class:`CacheFile` looks entries up and stores them by key, one
connection a process; the encoder decides what to embed (the misses) and how
(``GenerativeEncoder.set_rationale_cache``).

The module is the cache's file format: what a key covers, how an entry is encoded, how a foreign or damaged
file is recognised, and the SQLite access that relies on them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import numbers
import os
import re
import sqlite3
import threading
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from grace_st.settings import RATIONALE_SETTINGS

logger = logging.getLogger(__name__)

FORMAT_NAME = "grace-st-rationale-cache"
FORMAT_VERSION = 1
# Bumped whenever entry_key's encoding changes, so old keys can never alias new ones.
KEY_VERSION = 1
# Which draw a seed gives under sampling (grace_st.runtime.generation.inverse_cdf_draw since 2): keyed for
# sampled settings only, so greedy entries stay valid when the sampler changes.
SAMPLER_VERSION = 2

# entry_key refuses a settings dict without every one of these: each decides the result.
REQUIRED_SETTINGS = (*RATIONALE_SETTINGS, "eos_token_ids")

_SQLITE_MAGIC = b"SQLite format 3\x00"
# How SQLite reports a file or directory it may not write.
_READ_ONLY_MESSAGES = re.compile(r"readonly|read-only|unable to open database file", re.IGNORECASE)


def _serialised(method):
    """A :class:`RationaleCache` call that holds the cache's lock: threads sharing one take turns."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class _ReadOnlyFile(Exception):
    """The cache file exists but cannot be opened for writing."""


def _writable(path: str) -> bool:
    """False on a read-only mount (as root too, where ``os.access`` says yes) or without write permission."""
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return False
    except (OSError, AttributeError):
        pass
    return os.access(path, os.W_OK)


_INT32 = np.dtype("<i4")
_FLOAT32 = np.dtype("<f4")
# Stay under SQLite's host-parameter limit (999 on old builds) in IN (...) queries.
_QUERY_CHUNK = 500

_SCHEMA = (
    "CREATE TABLE metadata (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    # lengths: int32 per rationale; ids: the rationales' int32 ids concatenated;
    # truncated: one byte (0/1) per rationale; embedding: float32 x embedding_dim, or NULL.
    (
        "CREATE TABLE entries ("
        " key TEXT PRIMARY KEY,"
        " num_rationales INTEGER NOT NULL,"
        " lengths BLOB NOT NULL,"
        " ids BLOB NOT NULL,"
        " truncated BLOB NOT NULL,"
        " embedding_dim INTEGER,"
        " embedding BLOB"
        ") WITHOUT ROWID"
    ),
)


class CacheError(ValueError):
    """The cache file, or a row of it, is not what this version of grace-st wrote."""


@dataclass(eq=False)
class CacheEntry:
    """What the cache holds for one key.

    ``rationale_ids[k]`` is rationale k's token ids (EOS excluded), ``truncated[k]`` whether it
    hit the length limit without EOS, ``embedding`` the pooled vector (float32, 1-D) or None.
    """

    rationale_ids: list[list[int]]
    truncated: list[bool]
    embedding: np.ndarray | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CacheEntry):
            return NotImplemented
        if self.rationale_ids != other.rationale_ids or self.truncated != other.truncated:
            return False
        if self.embedding is None or other.embedding is None:
            return self.embedding is None and other.embedding is None
        return np.array_equal(self.embedding, other.embedding)


# -- keys ----------------------------------------------------------------------------------------


def _canonical(value: Any, where: str) -> Any:
    """A JSON value with one spelling per meaning: 1 and 1.0 are the same temperature."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"entry_key: {where} is {value!r}; only finite numbers can be keyed")
        return int(value) if value.is_integer() else value
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"entry_key: {where} has a non-string key {key!r}")
            out[key] = _canonical(item, f"{where}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [_canonical(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise TypeError(f"entry_key: {where} is a {type(value).__name__}; use str, numbers, bools, None, lists, dicts")


def entry_key(fingerprint: str, instruction: str, text: str, settings: Mapping[str, Any]) -> str:
    """The cache key of one text: a sha256 hex digest of a canonical JSON encoding of all parts.

    ``instruction`` is the full system instruction (task instruction plus any prompt), ``text``
    the raw user text, ``settings`` must hold every name in :data:`REQUIRED_SETTINGS` and may
    hold more (e.g. a tokenizer or chat-template fingerprint); all of it is keyed. Equal inputs
    give equal keys in any process; changing any part, any setting included, changes the key.
    Numbers are keyed by value (``1 == 1.0``); list order is kept (pass eos ids sorted).
    """
    if not isinstance(fingerprint, str) or not fingerprint:
        raise TypeError("entry_key: fingerprint must be a non-empty str (see weights_fingerprint)")
    if not isinstance(instruction, str) or not isinstance(text, str):
        raise TypeError("entry_key: instruction and text must be str")
    missing = [name for name in REQUIRED_SETTINGS if name not in settings]
    if missing:
        raise ValueError(
            f"entry_key: settings lack {missing}; every one of {list(REQUIRED_SETTINGS)} decides the result"
        )
    parts = {
        "key_version": KEY_VERSION,
        "fingerprint": fingerprint,
        "instruction": instruction,
        "text": text,
        "settings": _canonical(_keyed(settings), "settings"),
    }
    if settings.get("do_sample"):
        parts["sampler"] = SAMPLER_VERSION
    encoded = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(encoded.encode("utf-8")).hexdigest()


# Settings added after caches existed, at the value that computes what was computed before them: left out of the
# key there, so that entries written before the setting existed keep their keys.
NEUTRAL_SETTINGS = {"repetition_penalty": 1, "prompt_format": "chat", "soft_token_temperature": 1}


def _keyed(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings as keyed: each of :data:`NEUTRAL_SETTINGS` at its neutral value is left out."""
    return {k: v for k, v in settings.items() if not (k in NEUTRAL_SETTINGS and v == NEUTRAL_SETTINGS[k])}


def is_deterministic(settings: Mapping[str, Any]) -> bool:
    """True when the settings make the rationale a function of the inputs: greedy decoding,
    sampling with a seed (the encoder seeds each text from ``seed`` and the text), or no
    rationale at all. Only then may results be cached. "Function" up to floating point: a
    greedy near-tie can break differently on other hardware or in another batch, and the
    cache then returns one of the valid answers consistently.
    """
    if settings.get("max_rationale_tokens", None) == 0:
        return True
    return not settings["do_sample"] or settings["seed"] is not None


# -- encoding rows -------------------------------------------------------------------------------


def _encode(key: str, entry: CacheEntry) -> tuple:
    if not isinstance(key, str) or not key:
        raise TypeError(f"cache keys are non-empty str, got {key!r}")
    ids, truncated = entry.rationale_ids, entry.truncated
    if len(ids) != len(truncated):
        raise ValueError(f"key {key}: {len(ids)} rationales but {len(truncated)} truncated flags")
    lengths = np.array([len(row) for row in ids], dtype=_INT32)
    flat = [token for row in ids for token in row]
    flat_ids = np.array(flat, dtype=np.int64)
    if flat_ids.size and (flat_ids.min() < 0 or flat_ids.max() > np.iinfo(_INT32).max):
        raise ValueError(f"key {key}: token ids must lie in [0, 2**31)")
    embedding_dim = embedding = None
    if entry.embedding is not None:
        vector = np.asarray(entry.embedding, dtype=_FLOAT32)
        if vector.ndim != 1:
            raise ValueError(f"key {key}: the embedding must be one vector, got shape {vector.shape}")
        embedding_dim, embedding = int(vector.shape[0]), vector.tobytes()
    return (
        key,
        len(ids),
        lengths.tobytes(),
        flat_ids.astype(_INT32).tobytes(),
        bytes(bool(flag) for flag in truncated),
        embedding_dim,
        embedding,
    )


def _decode(row: tuple) -> CacheEntry:
    key, count, lengths, ids, truncated, embedding_dim, embedding = row

    def bad(what: str) -> CacheError:
        return CacheError(f"cache row {key!r} does not decode: {what}")

    if not isinstance(count, int) or count < 0:
        raise bad(f"num_rationales is {count!r}")
    for name, blob in (("lengths", lengths), ("ids", ids), ("truncated", truncated)):
        if not isinstance(blob, bytes):
            raise bad(f"{name} is a {type(blob).__name__}, not a blob")
    if len(lengths) != count * _INT32.itemsize:
        raise bad(f"lengths blob has {len(lengths)} bytes for {count} rationales")
    sizes = np.frombuffer(lengths, dtype=_INT32)
    if (sizes < 0).any():
        raise bad("a negative rationale length")
    if len(ids) != int(sizes.sum()) * _INT32.itemsize:
        raise bad(f"ids blob has {len(ids)} bytes for {int(sizes.sum())} int32 token ids")
    if len(truncated) != count or any(flag > 1 for flag in truncated):
        raise bad(f"truncated blob {truncated!r} for {count} rationales")
    tokens = np.frombuffer(ids, dtype=_INT32)
    if (tokens < 0).any():
        raise bad("a negative token id")
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    rationale_ids = [tokens[bounds[i] : bounds[i + 1]].tolist() for i in range(count)]
    vector = None
    if (embedding_dim is None) != (embedding is None):
        raise bad("embedding and embedding_dim must both be set or both NULL")
    if embedding is not None:
        if not isinstance(embedding, bytes) or not isinstance(embedding_dim, int) or embedding_dim < 0:
            raise bad(f"embedding of type {type(embedding).__name__} with dimension {embedding_dim!r}")
        if len(embedding) != embedding_dim * _FLOAT32.itemsize:
            raise bad(f"embedding blob has {len(embedding)} bytes for dimension {embedding_dim} float32")
        # a copy: frombuffer views are read-only and would pin the row's bytes
        vector = np.frombuffer(embedding, dtype=_FLOAT32).astype(np.float32)
    return CacheEntry(rationale_ids=rationale_ids, truncated=[bool(flag) for flag in truncated], embedding=vector)


# -- the cache -----------------------------------------------------------------------------------


class RationaleCache:
    """Rationales (and optionally pooled embeddings) by :func:`entry_key`, in one SQLite file.

    Args:
        path: the cache file. Created with its parent directory when missing; an existing file
            must be a cache this format version wrote and pass ``PRAGMA quick_check``, else
            :class:`CacheError` (the file is left untouched). A valid cache that cannot be
            written (a read-only mount, no write permission) is opened read-only: hits are
            served, new entries are not stored, and ``read_only`` is True. A path that is a
            symbolic link (nothing is created where it points) or not a regular file is refused
            (:class:`CacheError`).
        timeout: seconds a writer waits for another process's lock before giving up.

    Several processes may open the same file at once: WAL journaling lets readers run beside
    the one writer, and a busy timeout makes writers queue instead of failing. Each process
    must open its own ``RationaleCache``: a SQLite connection must not cross a ``fork``, so one
    that did raises :class:`CacheError`. Threads may share one: its reads and writes take turns
    on the one connection (a lock of its own), each a whole transaction.
    """

    def __init__(self, path: str | os.PathLike, *, timeout: float = 60.0) -> None:
        self.path = os.fspath(path)
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._conn: sqlite3.Connection | None = None
        self.read_only = False
        self._refuse_odd_path()
        self._check_header()
        parent = os.path.dirname(os.path.abspath(self.path))
        if os.path.isfile(self.path) and not _writable(self.path):
            self._conn = self._open_read_only()
            return
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as error:
            raise CacheError(f"{self.path}: cannot create the rationale cache's directory: {error}") from error
        if not os.path.exists(self.path) and not _writable(parent):
            raise CacheError(f"{self.path}: cannot create the rationale cache: {parent} is read-only")
        try:
            self._conn = self._open_writable(timeout)
        except _ReadOnlyFile:
            self._conn = self._open_read_only()

    def _open_writable(self, timeout: float) -> sqlite3.Connection:
        try:
            # isolation_level=None: transactions are begun and ended here, explicitly.
            # check_same_thread=False: threads share the connection, one call at a time (self._lock)
            conn = sqlite3.connect(self.path, timeout=timeout, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as error:
            raise CacheError(f"{self.path}: cannot open the rationale cache: {error}") from error
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
            created = self._initialise(conn)
            if not created:
                self._quick_check(conn)
            # WAL after validation, so a foreign file is never switched to it. Where WAL is not
            # available (some network file systems) the rollback journal plus busy timeout
            # still serialise writers correctly, only with less read concurrency.
            conn.execute("PRAGMA journal_mode = WAL").fetchone()
            # Safe in WAL mode: a power cut may lose the last commits, never corrupt the file.
            conn.execute("PRAGMA synchronous = NORMAL")
        except CacheError:
            conn.close()
            raise
        except sqlite3.OperationalError as error:
            conn.close()
            # A file we may read but not write (a read-only mount SQLite only finds out about
            # when it needs its journal) is still a valid cache to read.
            if os.path.isfile(self.path) and _READ_ONLY_MESSAGES.search(str(error)):
                raise _ReadOnlyFile from error
            raise CacheError(f"{self.path}: not a usable rationale cache: {error}") from error
        except sqlite3.Error as error:
            conn.close()
            raise CacheError(f"{self.path}: not a usable rationale cache: {error}") from error
        return conn

    def _open_read_only(self) -> sqlite3.Connection:
        """Read a cache that cannot be written: hits are served, new entries are not stored.

        ``immutable=1`` because SQLite cannot otherwise open a WAL-mode file whose directory
        it may not write (it wants the ``-shm`` file); entries still only in an
        un-checkpointed ``-wal`` are then not seen, and are generated again: slower, never wrong.
        """
        uri = f"file:{urllib.parse.quote(os.path.abspath(self.path))}?mode=ro&immutable=1"
        try:
            conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as error:
            raise CacheError(f"{self.path}: cannot open the read-only rationale cache: {error}") from error
        try:
            tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not tables:
                raise CacheError(f"{self.path}: an empty database on a read-only location, not a rationale cache")
            self._validate_metadata(conn, tables)
            self._quick_check(conn)
        except CacheError:
            conn.close()
            raise
        except sqlite3.Error as error:
            conn.close()
            raise CacheError(f"{self.path}: not a usable read-only rationale cache: {error}") from error
        self.read_only = True
        logger.warning(
            "%s: the rationale cache is read-only: cached rationales are used, new ones are not stored", self.path
        )
        return conn

    # -- opening ---------------------------------------------------------------------------------

    def _refuse_odd_path(self) -> None:
        """A cache path that is a symbolic link is refused, dangling or not: SQLite would follow it
        and create or change a database wherever it points (its journal beside the target), a
        file the user never named. So is one that exists and is not a regular file (a FIFO would
        block the header check, a device is nobody's cache)."""
        if os.path.islink(self.path):
            target = os.readlink(self.path)
            state = "" if os.path.exists(self.path) else ", which does not exist"
            raise CacheError(
                f"{self.path}: the rationale cache path is a symbolic link (to {target}{state}); "
                "refusing to follow it: give the cache's real path"
            )
        if os.path.exists(self.path) and not os.path.isfile(self.path):
            raise CacheError(f"{self.path}: not a regular file, so not a rationale cache; refusing to use it")

    def _check_header(self) -> None:
        # sqlite3 opens a non-database lazily and only fails at the first query; looking at the
        # magic first gives a plain message and guarantees we never write to such a file. The
        # message says what was missing, never the file's bytes (they may be anyone's data).
        try:
            with open(self.path, "rb") as handle:
                head = handle.read(len(_SQLITE_MAGIC))
        except FileNotFoundError:
            return
        except OSError as error:
            raise CacheError(f"{self.path}: cannot read the rationale cache: {error}") from error
        if head and head != _SQLITE_MAGIC:
            raise CacheError(
                f"{self.path}: not a SQLite database (the SQLite header is missing), so not a grace-st "
                "rationale cache; refusing to use or change it"
            )

    def _initialise(self, conn: sqlite3.Connection) -> bool:
        """Create the schema in an empty database, or validate an existing one. True if created.

        One IMMEDIATE transaction: of several processes opening a new file at once, one
        creates the schema and the others then find and validate it.
        """
        conn.execute("BEGIN IMMEDIATE")
        try:
            tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not tables:
                # An empty database (a new or zero-byte file) holds nothing to trust or lose.
                for statement in _SCHEMA:
                    conn.execute(statement)
                conn.executemany(
                    "INSERT INTO metadata (key, value) VALUES (?, ?)",
                    [("format", FORMAT_NAME), ("version", str(FORMAT_VERSION))],
                )
                conn.execute("COMMIT")
                return True
            self._validate_metadata(conn, tables)
            conn.execute("COMMIT")
            return False
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _validate_metadata(self, conn: sqlite3.Connection, tables: set[str]) -> None:
        if "metadata" not in tables:
            raise CacheError(
                f"{self.path}: a SQLite database without a metadata table (tables: {sorted(tables)}), "
                "not a rationale cache; refusing to use or change it"
            )
        try:
            metadata = dict(conn.execute("SELECT key, value FROM metadata"))
        except sqlite3.Error as error:
            raise CacheError(f"{self.path}: unreadable metadata table ({error}), not a rationale cache") from error
        if metadata.get("format") != FORMAT_NAME:
            raise CacheError(
                f"{self.path}: metadata format is {metadata.get('format')!r}, expected {FORMAT_NAME!r}; "
                "not a rationale cache, refusing to use or change it"
            )
        if metadata.get("version") != str(FORMAT_VERSION):
            raise CacheError(
                f"{self.path}: rationale cache format version {metadata.get('version')!r}, this grace-st reads "
                f"version {FORMAT_VERSION}; use another path or delete the file"
            )
        if "entries" not in tables:
            raise CacheError(f"{self.path}: rationale cache metadata but no entries table; the file is damaged")

    def _quick_check(self, conn: sqlite3.Connection) -> None:
        problems = [row[0] for row in conn.execute("PRAGMA quick_check")]
        if problems != ["ok"]:
            shown = "; ".join(str(p) for p in problems[:5])
            raise CacheError(f"{self.path}: the rationale cache is corrupt (PRAGMA quick_check: {shown})")

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise CacheError(f"{self.path}: the rationale cache is closed")
        if os.getpid() != self._pid:
            raise CacheError(
                f"{self.path}: this RationaleCache was opened in process {self._pid} and used in {os.getpid()}; "
                "open one in each process (a SQLite connection must not cross a fork)"
            )
        return self._conn

    # -- reading and writing -----------------------------------------------------------------------

    @_serialised
    def get_many(self, keys: Iterable[str]) -> dict[str, CacheEntry]:
        """The entries of those ``keys`` that are cached (absent keys are simply missing).

        Raises :class:`CacheError` naming the key of a row that does not decode.
        """
        conn = self._connection()
        wanted = list(dict.fromkeys(keys))
        found: dict[str, CacheEntry] = {}
        try:
            for start in range(0, len(wanted), _QUERY_CHUNK):
                chunk = wanted[start : start + _QUERY_CHUNK]
                rows = conn.execute(
                    "SELECT key, num_rationales, lengths, ids, truncated, embedding_dim, embedding FROM entries "
                    f"WHERE key IN ({', '.join('?' * len(chunk))})",
                    chunk,
                )
                for row in rows:
                    found[row[0]] = _decode(row)
        except sqlite3.DatabaseError as error:
            raise CacheError(f"{self.path}: reading the rationale cache failed: {error}") from error
        return found

    @_serialised
    def put_many(self, entries: Mapping[str, CacheEntry]) -> None:
        """Store (or replace) every entry in one transaction: all of them land, or none.
        A read-only cache stores nothing (it warned so when opened)."""
        rows = [_encode(key, entry) for key, entry in entries.items()]
        if not rows or self.read_only:
            return
        conn = self._connection()
        try:
            # IMMEDIATE takes the write lock up front, so a busy writer is waited for here
            # (busy timeout) rather than failing halfway through the transaction.
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.executemany(
                    "INSERT OR REPLACE INTO entries "
                    "(key, num_rationales, lengths, ids, truncated, embedding_dim, embedding) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    rows,
                )
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        except sqlite3.DatabaseError as error:
            raise CacheError(f"{self.path}: writing to the rationale cache failed: {error}") from error

    @_serialised
    def __len__(self) -> int:
        (count,) = self._connection().execute("SELECT COUNT(*) FROM entries").fetchone()
        return int(count)

    @_serialised
    def clear(self) -> None:
        """Delete every entry (the file, its format and metadata stay)."""
        conn = self._connection()
        if self.read_only:
            raise CacheError(f"{self.path}: the rationale cache is read-only; nothing was deleted")
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute("DELETE FROM entries")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    @_serialised
    def close(self) -> None:
        """Close the connection; further use raises :class:`CacheError`. Closing twice is fine."""
        if self._conn is not None and os.getpid() == self._pid:
            self._conn.close()
        self._conn = None

    def __enter__(self) -> RationaleCache:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._conn is None else "open"
        return f"RationaleCache({self.path!r}, {state})"


_opening = threading.Lock()


class CacheFile:
    """One cache file as a model uses it: a :class:`RationaleCache` connection a process (a sqlite
    connection must not cross a fork or a pickle), shared by the process's threads (the cache
    serialises their calls). A corrupt or foreign file is refused on construction."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._open: tuple[int, RationaleCache] | None = None  # (process id, connection)
        self.connection()

    def connection(self) -> RationaleCache:
        # the lock makes it one connection for the process, not one a thread
        with _opening:
            if self._open is None or self._open[0] != os.getpid():
                self._open = (os.getpid(), RationaleCache(self.path))
            return self._open[1]

    def lookup(self, keys: Iterable[str]) -> dict[str, CacheEntry]:
        """The stored entries among ``keys`` that carry an embedding (what answers a text alone)."""
        found = self.connection().get_many(keys)
        return {key: entry for key, entry in found.items() if entry.embedding is not None}

    def store(self, entries: Mapping[str, CacheEntry]) -> None:
        self.connection().put_many(entries)

    @staticmethod
    def keys(
        weights: str, instruction: str, texts: Sequence[str], rows: Sequence[Sequence[int]], settings: Mapping[str, Any]
    ) -> list[str]:
        """Each text's entry key: the weights, the instruction, the text, the prompt's token ids
        (tokenizer, template and truncation included) and every generation setting."""
        return [
            entry_key(weights, instruction, text, {**settings, "prompt_token_ids": row})
            for text, row in zip(texts, rows)
        ]

    def close(self) -> None:
        if self._open is not None and self._open[0] == os.getpid():
            self._open[1].close()
        self._open = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": None}
