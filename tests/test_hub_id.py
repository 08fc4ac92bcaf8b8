"""Loading a GRACE model by Hub id, offline, the way a user who downloaded it once runs it:
``SentenceTransformer("org/grace-4b", trust_remote_code=True)`` with ``HF_HUB_OFFLINE=1`` and
the model in a Hugging Face cache laid out exactly as ``huggingface_hub`` lays out a snapshot
(``models--org--name/{blobs,refs,snapshots}``; snapshot files are relative symlinks to blobs
named by their hash). The Hub itself is never reached."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import huggingface_hub
import numpy as np
import pytest
import sentence_transformers
from conftest import make_st_model
from huggingface_hub import constants
from sentence_transformers import SentenceTransformer

from grace_st.encoder import GenerativeEncoder
from grace_st.files.hub import snapshot_repo
from grace_st.files.mteb_identity import model_id as _model_id

ST_MAJOR = int(sentence_transformers.__version__.split(".")[0])
TEXTS = ["A man is playing a guitar.", "The central bank raised rates."]
REPO = "org/grace-4b"


# -- a Hugging Face cache, as huggingface_hub writes it ---------------------------------------


def _etag(path: Path) -> str:
    """What huggingface_hub names a blob by: the sha256 of an LFS file (safetensors are LFS on
    the Hub), the git blob sha1 of any other."""
    data = path.read_bytes()
    if path.suffix == ".safetensors":
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def cache_snapshot(source: Path, repo_id: str, cache: Path, refs=("main",), leave_out=()) -> tuple[Path, str]:
    """Put directory ``source`` into ``cache`` as a commit of ``repo_id``: (snapshot dir, commit)."""
    files = sorted(p for p in source.rglob("*") if p.is_file() and p.name not in leave_out)
    etags = {f.relative_to(source).as_posix(): _etag(f) for f in files}
    commit = hashlib.sha1(json.dumps(etags, sort_keys=True).encode()).hexdigest()
    repo = cache / huggingface_hub.file_download.repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = repo / "snapshots" / commit
    for file in files:
        blob = repo / "blobs" / etags[file.relative_to(source).as_posix()]
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            shutil.copyfile(file, blob)
        link = snapshot / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot, commit


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline, pointed to everywhere it is read."""
    home = tmp_path / "hf_home"
    cache = home / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("SENTENCE_TRANSFORMERS_HOME", raising=False)
    # read once at import time by huggingface_hub, and from there by transformers and sentence-transformers
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two saved GRACE models (2- and 3-token rationales) and the embeddings the first gives."""
    root = tmp_path_factory.mktemp("grace-src")
    model = make_st_model(max_rationale_tokens=2)
    expected = model.encode(TEXTS)
    model.save(str(root / "v2"))
    make_st_model(max_rationale_tokens=3).save(str(root / "v3"))
    return root, expected


def load(name, **kwargs):
    return SentenceTransformer(name, trust_remote_code=True, device="cpu", **kwargs)


def filed_under(model) -> tuple[str | None, str | None]:
    """The name and revision mteb reads from the model card data. sentence-transformers 5.x has
    no on_model_ready hook, so there the encoder is asked to describe itself (grace-st eval does)."""
    if ST_MAJOR < 6:
        model[0].describe_for_mteb(model)
    return model.model_card_data.model_name, model.model_card_data.base_model_revision


# -- the cache layout ----------------------------------------------------------------------------


def test_fake_cache_is_the_layout_huggingface_hub_reads(hf_cache, saved):
    source = saved[0] / "v2"
    snapshot, commit = cache_snapshot(source, REPO, hf_cache)
    (repo,) = huggingface_hub.scan_cache_dir(hf_cache).repos
    assert (repo.repo_id, repo.repo_type) == (REPO, "model")
    (revision,) = repo.revisions
    assert (revision.commit_hash, set(revision.refs), revision.snapshot_path) == (commit, {"main"}, snapshot)
    assert revision.nb_files == len([p for p in source.rglob("*") if p.is_file()])
    found = huggingface_hub.try_to_load_from_cache(REPO, "grace_config.json")  # the default cache: ours
    assert found == str(snapshot / "grace_config.json")
    assert huggingface_hub.snapshot_download(REPO, local_files_only=True) == str(snapshot)
    weights = snapshot / "model.safetensors"
    assert weights.is_symlink() and not os.path.isabs(os.readlink(weights))
    blob = Path(os.path.realpath(weights))
    assert blob.parent.name == "blobs" and blob.name == hashlib.sha256(blob.read_bytes()).hexdigest()
    assert snapshot_repo(snapshot) == (REPO, commit) and os.environ["HF_HUB_OFFLINE"] == "1"


# -- loading by id -------------------------------------------------------------------------------


def test_loads_by_repo_id_offline_and_is_filed_under_the_id_and_commit(hf_cache, saved):
    _, commit = cache_snapshot(saved[0] / "v2", REPO, hf_cache)
    model = load(REPO)
    np.testing.assert_allclose(model.encode(TEXTS), saved[1], atol=1e-5)
    assert model[0].model_id == REPO
    assert filed_under(model) == (REPO, commit)


def test_mteb_files_results_under_the_repo_id_and_commit(hf_cache, saved):
    pytest.importorskip("mteb")
    from mteb.models import SentenceTransformerEncoderWrapper

    _, commit = cache_snapshot(saved[0] / "v2", REPO, hf_cache)
    model = load(REPO)
    filed_under(model)
    meta = SentenceTransformerEncoderWrapper(model).mteb_model_meta
    assert (meta.name, meta.revision) == (REPO, commit)


def test_load_gets_the_repo_id_and_a_snapshot_path_maps_back(hf_cache, saved, monkeypatch):
    snapshot, commit = cache_snapshot(saved[0] / "v2", REPO, hf_cache)
    received = []
    original = GenerativeEncoder.load.__func__

    def spy(cls, model_name_or_path, *args, **kwargs):
        received.append(model_name_or_path)
        return original(cls, model_name_or_path, *args, **kwargs)

    monkeypatch.setattr(GenerativeEncoder, "load", classmethod(spy))
    load(REPO)
    # sentence-transformers 5.2 and 6.2 both hand the module the id; a version handing it the
    # resolved snapshot path is covered by loading from that path below
    assert received == [REPO]
    by_path = load(str(snapshot))
    assert received[-1] == str(snapshot)
    assert by_path[0].model_id == REPO and filed_under(by_path) == (REPO, commit)
    np.testing.assert_allclose(by_path.encode(TEXTS), saved[1], atol=1e-5)


def test_model_id_of_ids_snapshots_and_directories(tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    assert _model_id(str(snapshot)) == "org/name" and snapshot_repo(str(snapshot) + "/") == ("org/name", commit)
    bare = tmp_path / "hub" / "models--gpt2" / "snapshots" / commit
    bare.mkdir(parents=True)
    assert _model_id(str(bare)) == "local/gpt2"  # as the bare id "gpt2" itself
    assert _model_id("org/name") == "org/name" and _model_id("gpt2") == "local/gpt2"
    assert _model_id(str(tmp_path / "hub")) == "local/hub"
    for not_a_snapshot in (tmp_path / "hub" / "models--org--name", tmp_path / "x" / "snapshots" / commit):
        assert snapshot_repo(not_a_snapshot) is None
    assert snapshot_repo(tmp_path / "hub" / "models--org--name" / "snapshots" / "main") is None


@pytest.mark.parametrize("pin", ["commit", "branch"])
def test_a_pinned_revision_gives_that_commit(hf_cache, saved, pin):
    _, latest = cache_snapshot(saved[0] / "v2", REPO, hf_cache)
    _, older = cache_snapshot(saved[0] / "v3", REPO, hf_cache, refs=("v1",))
    model = load(REPO, revision=older if pin == "commit" else "v1")
    assert model[0].max_rationale_tokens == 3
    # a branch pins a commit: the commit is what results are filed under, not the branch name
    assert filed_under(model) == (REPO, older)
    assert filed_under(load(REPO)) == (REPO, latest)


def test_settings_changed_at_run_time_extend_the_commit(hf_cache, saved):
    _, commit = cache_snapshot(saved[0] / "v2", REPO, hf_cache)
    model = load(REPO)
    encoder = model[0]
    assert filed_under(model) == (REPO, commit)
    encoder.max_rationale_tokens = 1
    encoder.describe_for_mteb(model)
    changed = model.model_card_data.base_model_revision
    assert changed.startswith(commit + "-") and model.model_card_data.model_name == REPO
    encoder.max_rationale_tokens = 2
    encoder.describe_for_mteb(model)
    assert model.model_card_data.base_model_revision == commit


def test_a_cache_folder_given_to_sentence_transformers_is_the_one_read(hf_cache, saved, tmp_path):
    other = tmp_path / "elsewhere"
    _, commit = cache_snapshot(saved[0] / "v2", REPO, other)
    model = load(REPO, cache_folder=str(other))
    assert filed_under(model) == (REPO, commit)
    assert not list(hf_cache.iterdir())  # the default cache was never needed


# -- a base + adapter model whose base is a Hub id -----------------------------------------------


@pytest.fixture(scope="module")
def adapter_source(tmp_path_factory):
    """A GRACE LoRA directory naming its base by Hub id (``org/tiny-base``), the base apart, and
    the embeddings the pair gives."""
    from test_adapter import adapter_model

    root = tmp_path_factory.mktemp("grace-lora-src")
    model, _ = adapter_model(root)
    expected = model.encode(TEXTS)
    config_path = root / "grace-lora" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "base_model_name_or_path": "org/tiny-base"}))
    return root / "base", root / "grace-lora", expected


def test_adapter_repo_finds_its_hub_base_in_the_cache(hf_cache, adapter_source):
    base, adapter, expected = adapter_source
    _, base_commit = cache_snapshot(base, "org/tiny-base", hf_cache)
    _, commit = cache_snapshot(adapter, "org/grace-lora", hf_cache)
    assert base_commit != commit
    # the adapter's commit is pinned: it must not be asked of the base's repository
    model = load("org/grace-lora", revision=commit)
    assert not hasattr(model[0].model, "peft_config")  # merged, as from a directory
    np.testing.assert_allclose(model.encode(TEXTS), expected, atol=1e-5)
    assert filed_under(model) == ("org/grace-lora", commit)


def test_adapter_base_missing_from_the_cache_says_what_to_download(hf_cache, adapter_source):
    _, adapter, _ = adapter_source
    cache_snapshot(adapter, "org/grace-lora", hf_cache)
    with pytest.raises(FileNotFoundError) as error:
        load("org/grace-lora")
    message = str(error.value)
    assert "org/tiny-base" in message and "base model of the adapter" in message
    assert str(hf_cache) in message and "`hf download org/tiny-base`" in message and "HF_HUB_OFFLINE=0" in message


# -- what is missing -----------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["repo not cached", "revision not cached"])
def test_missing_snapshot_fails_in_sentence_transformers_before_grace(hf_cache, saved, case):
    """Without modules.json sentence-transformers never learns this is a GRACE model: 5.x and
    6.x both fall back to a plain Transformer module, and transformers raises its OSError
    ("couldn't find them in the cached files"); no grace_st code runs, so no message of ours.
    GenerativeEncoder.load itself, reached the same way, says what to download."""
    if case == "repo not cached":
        kwargs = {}
    else:
        cache_snapshot(saved[0] / "v2", REPO, hf_cache)
        kwargs = {"revision": "f" * 40}
    with pytest.raises(OSError, match="cached files"):
        load(REPO, **kwargs)
    with pytest.raises(FileNotFoundError) as error:
        GenerativeEncoder.load(REPO, **kwargs)
    message = str(error.value)
    command = f"hf download {REPO}" + (" --revision " + "f" * 40 if kwargs else "")
    assert f"{REPO}" in message and f"looked in {hf_cache}" in message and f"`{command}`" in message
    assert "HF_HUB_OFFLINE=1" in message and "HF_HUB_OFFLINE=0" in message


def test_partial_snapshot_says_what_to_download(hf_cache, saved):
    snapshot, _ = cache_snapshot(saved[0] / "v2", REPO, hf_cache, leave_out=("model.safetensors",))
    with pytest.raises(FileNotFoundError) as error:
        load(REPO)
    message = str(error.value)
    assert f"{REPO}:" in message and str(snapshot) in message and "lacks model.safetensors" in message
    assert f"`hf download {REPO}`" in message and "HF_HUB_OFFLINE=0" in message


def test_local_files_only_without_offline_mode_names_that_switch(hf_cache, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    other = hf_cache.parent / "st-cache"
    with pytest.raises(FileNotFoundError) as error:
        GenerativeEncoder.load(REPO, revision="v1", local_files_only=True, cache_folder=str(other))
    message = str(error.value)
    assert f"{REPO} at revision v1" in message and f"looked in {other}" in message
    assert f"`hf download {REPO} --revision v1 --cache-dir {other}`" in message
    assert "local_files_only=True" in message and "pass local_files_only=False" in message
    assert "HF_HUB_OFFLINE" not in message


def test_online_a_hub_id_is_downloaded_as_one_snapshot(hf_cache, saved, monkeypatch):
    """With downloads on, the snapshot comes from snapshot_download (stood in for here: no
    network), without pickled weights, at the commit sentence-transformers 6.x resolved."""
    snapshot, commit = cache_snapshot(saved[0] / "v2", REPO, hf_cache)
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(snapshot)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    revision = commit
    if ST_MAJOR >= 6:
        revision = huggingface_hub.ResolvedRevision(initial="v1", resolved=commit)
    encoder = GenerativeEncoder.load(REPO, revision=revision)
    ((repo_id, kwargs),) = calls
    assert repo_id == REPO and kwargs["revision"] == commit and kwargs["local_files_only"] is False
    assert "*.bin" in kwargs["ignore_patterns"]
    assert encoder.model_id == REPO and snapshot_repo(encoder._source_path) == (REPO, commit)
