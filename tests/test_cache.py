"""The persistent rationale cache: round trips, several processes, refusing foreign or corrupt files, keys."""

import multiprocessing
import sqlite3
import sys

import numpy as np
import pytest
import torch
from conftest import deadline, make_model, make_tokenizer

from grace_st.cache import (
    FORMAT_NAME,
    CacheEntry,
    CacheError,
    RationaleCache,
    entry_key,
    is_deterministic,
)
from grace_st.runtime.weights import weights_fingerprint

SETTINGS = {
    "method": "grace",
    "prompt_format": "chat",
    "soft_token_temperature": 1.0,
    "max_rationale_tokens": 256,
    "max_input_tokens": 1024,
    "do_sample": False,
    "temperature": 1.0,
    "top_p": 1.0,
    "repetition_penalty": 1.0,
    "seed": 0,
    "num_rationales": 1,
    "hidden_layer": -1,
    "eos_token_ids": [2],
}


def _entry(i: int, embedding: bool = True) -> CacheEntry:
    rng = np.random.default_rng(i)
    count = 1 + i % 3
    return CacheEntry(
        rationale_ids=[rng.integers(0, 50_000, size=int(rng.integers(0, 20))).tolist() for _ in range(count)],
        truncated=[bool((i + k) % 2) for k in range(count)],
        embedding=rng.standard_normal(16).astype(np.float32) if embedding else None,
    )


def test_round_trip_and_reopen(tmp_path):
    path = tmp_path / "sub" / "cache.sqlite"
    entries = {f"key{i}": _entry(i, embedding=i % 2 == 0) for i in range(20)}
    entries["empty"] = CacheEntry(rationale_ids=[[]], truncated=[False])
    with RationaleCache(path) as cache:
        assert len(cache) == 0 and cache.get_many(["key0"]) == {}
        cache.put_many(entries)
        assert len(cache) == len(entries)
        got = cache.get_many([*entries, "missing"])
        assert set(got) == set(entries)
        assert all(got[k] == entries[k] for k in entries)
        assert got["key0"].embedding.dtype == np.float32 and got["key1"].embedding is None
        # put replaces
        cache.put_many({"key0": _entry(100)})
        assert cache.get_many(["key0"])["key0"] == _entry(100)
    with RationaleCache(path) as cache:
        assert len(cache) == len(entries)
        assert cache.get_many(["key3"])["key3"] == entries["key3"]
        cache.clear()
        assert len(cache) == 0
    with pytest.raises(CacheError, match="closed"):
        len(cache)


def test_put_many_is_one_transaction(tmp_path):
    with RationaleCache(tmp_path / "c.sqlite") as cache:
        bad = {"a": _entry(1), "b": CacheEntry(rationale_ids=[[1, 2]], truncated=[True, False])}
        with pytest.raises(ValueError, match="2 truncated flags"):
            cache.put_many(bad)
        with pytest.raises(ValueError, match="token ids"):
            cache.put_many({"a": _entry(1), "b": CacheEntry(rationale_ids=[[-1]], truncated=[False])})
        assert len(cache) == 0


def _writer(path: str, worker: int, rows: int, queue) -> None:
    """One process: write rows in small transactions, reading back its own and the other's as it goes."""
    try:
        with RationaleCache(path, timeout=30) as cache:
            for start in range(0, rows, 10):
                batch = {f"w{worker}-{i}": _entry(i) for i in range(start, start + 10)}
                cache.put_many(batch)
                assert cache.get_many(batch) == batch
                other = cache.get_many([f"w{1 - worker}-{i}" for i in range(rows)])
                assert all(entry == _entry(int(key.split("-")[1])) for key, entry in other.items())
        queue.put((worker, None))
    except Exception as error:  # report to the parent instead of dying silently
        queue.put((worker, repr(error)))


def test_two_processes_write_and_read_concurrently(tmp_path):
    # fork: the children need no re-import of torch and grace-st (seconds each with spawn)
    context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    # a new path: both processes race to create the file and its schema, then write
    path = str(tmp_path / "shared.sqlite")
    rows = 300
    queue = context.Queue()
    workers = [context.Process(target=_writer, args=(path, w, rows, queue)) for w in (0, 1)]
    for process in workers:
        process.start()
    results = dict(queue.get(timeout=60) for _ in workers)
    for process in workers:
        process.join(timeout=60)
    assert results == {0: None, 1: None}
    with RationaleCache(path) as cache:
        assert len(cache) == 2 * rows
        keys = [f"w{w}-{i}" for w in (0, 1) for i in range(rows)]
        got = cache.get_many(keys)
        assert all(got[key] == _entry(int(key.split("-")[1])) for key in keys)


def test_a_cache_that_crossed_a_fork_refuses_to_work(tmp_path):
    cache = RationaleCache(tmp_path / "c.sqlite")
    cache._pid = -1  # as if this object had been inherited by a forked child
    with pytest.raises(CacheError, match="open one in each process"):
        cache.get_many(["a"])
    cache._pid = __import__("os").getpid()
    cache.close()


def test_garbage_file_is_refused_and_left_untouched(tmp_path):
    path = tmp_path / "garbage.sqlite"
    content = b"this is not a database at all\n" * 100
    path.write_bytes(content)
    with pytest.raises(CacheError, match="not a SQLite database") as info:
        RationaleCache(path)
    assert str(path) in str(info.value)
    assert path.read_bytes() == content


def test_a_foreign_file_is_refused_without_echoing_its_content(tmp_path):
    path = tmp_path / "notes.sqlite"
    path.write_bytes(b"password=hunter2\n" * 4)
    with pytest.raises(CacheError) as info:
        RationaleCache(path)
    message = str(info.value)
    assert message.startswith(f"{path}: not a SQLite database (the SQLite header is missing)")
    assert "grace-st rationale cache" in message and "hunter2" not in message and "password" not in message


@pytest.mark.parametrize("target", ["dangling", "a cache"])
def test_a_symlinked_cache_path_is_refused_and_nothing_is_made_at_its_target(tmp_path, target):
    elsewhere = tmp_path / "elsewhere.sqlite"
    if target == "a cache":
        RationaleCache(elsewhere).close()
    before = sorted(p.name for p in tmp_path.iterdir())
    link = tmp_path / "cache.sqlite"
    link.symlink_to(elsewhere)
    with pytest.raises(CacheError, match="is a symbolic link") as info:
        RationaleCache(link)
    assert str(link) in str(info.value) and str(elsewhere) in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir() if p != link) == before  # no database, no -wal, no -journal


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_cache_path_that_is_not_a_regular_file_is_refused(tmp_path, kind):
    import os

    path = tmp_path / "cache.sqlite"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    with deadline(30), pytest.raises(CacheError, match="not a regular file"):  # a FIFO once blocked the open
        RationaleCache(path)


def test_sqlite_header_with_garbage_body_is_refused(tmp_path):
    path = tmp_path / "fake.sqlite"
    path.write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 40)
    with pytest.raises(CacheError) as info:
        RationaleCache(path)
    assert str(path) in str(info.value)


def test_foreign_sqlite_file_is_refused_and_left_untouched(tmp_path):
    path = tmp_path / "foreign.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
    before = path.read_bytes()
    with pytest.raises(CacheError, match="without a metadata table") as info:
        RationaleCache(path)
    assert str(path) in str(info.value)
    assert path.read_bytes() == before
    with sqlite3.connect(path) as conn:  # not switched to WAL either
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"


def test_other_format_name_is_refused(tmp_path):
    path = tmp_path / "other.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE metadata (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        conn.execute("INSERT INTO metadata VALUES ('format', 'someone-elses-cache'), ('version', '1')")
    with pytest.raises(CacheError, match="someone-elses-cache"):
        RationaleCache(path)


def test_wrong_version_is_refused(tmp_path):
    path = tmp_path / "v.sqlite"
    RationaleCache(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE metadata SET value = '99' WHERE key = 'version'")
    with pytest.raises(CacheError, match="version '99'") as info:
        RationaleCache(path)
    assert str(path) in str(info.value)


def test_empty_file_becomes_a_cache(tmp_path):
    # A zero-byte file is an empty database: nothing to trust or lose (and what a racing
    # process sees between another's create and its schema commit).
    path = tmp_path / "empty.sqlite"
    path.touch()
    with RationaleCache(path) as cache:
        cache.put_many({"k": _entry(0)})
    with sqlite3.connect(path) as conn:
        assert dict(conn.execute("SELECT key, value FROM metadata"))["format"] == FORMAT_NAME


@pytest.mark.parametrize(
    ("column", "value", "what"),
    [
        ("ids", b"\x01\x02\x03", "ids blob has 3 bytes"),
        ("lengths", b"\x00", "lengths blob"),
        ("truncated", b"\x07", "truncated blob"),
        ("embedding", np.zeros(15, np.float32).tobytes(), "dimension 16"),
        ("embedding_dim", None, "both be set"),
        ("ids", "text, not a blob", "not a blob"),
    ],
    ids=["short-ids", "short-lengths", "bad-flag", "short-embedding", "dim-missing", "text-not-blob"],
)
def test_corrupted_row_names_its_key(tmp_path, column, value, what):
    path = tmp_path / "c.sqlite"
    with RationaleCache(path) as cache:
        cache.put_many({"good": _entry(0), "bad": _entry(0)})
    with sqlite3.connect(path) as conn:
        conn.execute(f"UPDATE entries SET {column} = ? WHERE key = 'bad'", (value,))
    with RationaleCache(path) as cache:
        assert cache.get_many(["good"])["good"] == _entry(0)
        with pytest.raises(CacheError, match=what) as info:
            cache.get_many(["good", "bad"])
        assert "'bad'" in str(info.value)


def test_damaged_pages_are_detected(tmp_path):
    path = tmp_path / "c.sqlite"
    with RationaleCache(path) as cache:
        cache.put_many({f"k{i}": _entry(i) for i in range(400)})
    with sqlite3.connect(path) as conn:  # fold the WAL back so every page is in the main file
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray(path.read_bytes())
    page = 4096
    assert len(data) > 6 * page
    data[3 * page : 5 * page] = b"\xa5" * (2 * page)  # two b-tree pages overwritten with junk
    path.write_bytes(bytes(data))
    with pytest.raises(CacheError, match="c.sqlite"), RationaleCache(path) as cache:
        cache.get_many([f"k{i}" for i in range(400)])


# -- keys -----------------------------------------------------------------------------------


def test_key_depends_on_every_part():
    fingerprint = "f" * 64
    base = entry_key(fingerprint, "Read the text.", "a cat", SETTINGS)
    assert base == entry_key(fingerprint, "Read the text.", "a cat", dict(reversed(SETTINGS.items())))
    assert len(base) == 64 and int(base, 16) >= 0
    variants = {
        entry_key("e" * 64, "Read the text.", "a cat", SETTINGS),
        entry_key(fingerprint, "Read the query.", "a cat", SETTINGS),
        entry_key(fingerprint, "Read the text.", "a cat ", SETTINGS),
        entry_key(fingerprint, "Read the text.", "a dog", SETTINGS),
        # the boundary between instruction and text is part of the key
        entry_key(fingerprint, "Read the text. a", "cat", SETTINGS),
    }
    changed = {
        "method": "gircse",
        "prompt_format": "instruct",
        "soft_token_temperature": 0.5,
        "max_rationale_tokens": 128,
        "max_input_tokens": 512,
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.9,
        "repetition_penalty": 1.2,
        "seed": 1,
        "num_rationales": 4,
        "hidden_layer": 3,
        "eos_token_ids": [2, 5],
        "tokenizer": "abc",  # extra entries are keyed too
    }
    for name, value in changed.items():
        variants.add(entry_key(fingerprint, "Read the text.", "a cat", {**SETTINGS, name: value}))
    assert base not in variants and len(variants) == 5 + len(changed)
    # a value, not its spelling, is keyed
    assert base == entry_key(fingerprint, "Read the text.", "a cat", {**SETTINGS, "temperature": 1, "top_p": 1})
    assert base == entry_key(fingerprint, "Read the text.", "a cat", {**SETTINGS, "eos_token_ids": (2,)})
    assert base == entry_key(fingerprint, "Read the text.", "a cat", {**SETTINGS, "seed": np.int64(0)})
    # no penalty is keyed as before the setting existed (this digest is the key grace-st gave then): old caches still hit
    assert base == "cbe809536031cb000efb406af8f682f0cb3c14b2a5b2b629fb979a722a244d35"


def test_sampled_keys_name_the_sampler_and_greedy_keys_do_not(monkeypatch):
    """A new sampler draws other rationales from the same seed: sampled entries written by the
    old one must miss, greedy entries must still hit."""
    from grace_st import cache

    sampled = {**SETTINGS, "do_sample": True}
    before = [entry_key("f" * 64, "Read.", "a cat", settings) for settings in (SETTINGS, sampled)]
    monkeypatch.setattr(cache, "SAMPLER_VERSION", cache.SAMPLER_VERSION + 1)
    after = [entry_key("f" * 64, "Read.", "a cat", settings) for settings in (SETTINGS, sampled)]
    assert before[0] == after[0] and before[1] != after[1]


def test_key_refuses_incomplete_or_unkeyable_settings():
    with pytest.raises(ValueError, match="seed"):
        entry_key("f", "i", "t", {k: v for k, v in SETTINGS.items() if k != "seed"})
    with pytest.raises(ValueError, match="finite"):
        entry_key("f", "i", "t", {**SETTINGS, "temperature": float("nan")})
    with pytest.raises(TypeError, match="settings.extra"):
        entry_key("f", "i", "t", {**SETTINGS, "extra": object()})


def test_fingerprint_changes_with_the_weights():
    tokenizer = make_tokenizer()
    model = make_model(tokenizer)
    fingerprint = weights_fingerprint(model)
    assert fingerprint == weights_fingerprint(make_model(tokenizer))  # same seed, same weights
    assert fingerprint != weights_fingerprint(make_model(tokenizer, seed=1))
    weight = model.model.layers[1].mlp.down_proj.weight
    original = weight[3, 5].item()
    with torch.no_grad():
        weight[3, 5] = original + 1e-3
    changed = weights_fingerprint(model)
    assert changed != fingerprint
    with torch.no_grad():
        weight[3, 5] = original
    assert weights_fingerprint(model) == fingerprint
    assert weights_fingerprint(model.to(torch.bfloat16)) not in (fingerprint, changed)
    key = entry_key(fingerprint, "i", "t", SETTINGS)
    assert key != entry_key(changed, "i", "t", SETTINGS)


def test_fingerprint_includes_config_values_in_no_tensor():
    tokenizer = make_tokenizer()
    model = make_model(tokenizer)
    fingerprint = weights_fingerprint(model)
    model.config.rms_norm_eps = 1e-5
    assert weights_fingerprint(model) != fingerprint
    model.config.rms_norm_eps = 1e-6
    model.config._name_or_path = "/somewhere/else"  # where it was loaded from does not matter
    assert weights_fingerprint(model) == fingerprint


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, True),  # greedy
        ({"seed": None}, True),  # greedy needs no seed
        ({"do_sample": True, "seed": 0}, True),
        ({"do_sample": True, "seed": None}, False),
        ({"do_sample": True, "seed": None, "max_rationale_tokens": 0}, True),  # nothing is generated
    ],
)
def test_is_deterministic(changes, expected):
    assert is_deterministic({**SETTINGS, **changes}) is expected
