"""GRC's files (grc.md, "Memory files"): what a memory file holds, where it may be written, which memories a model
refuses to read, and an adapter folder whose learned-state files changed after saving; on tiny random models."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import deadline, make_model, make_tokenizer
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_adapter import adapter_model
from test_bad_input import run_cli
from test_grc import BUDGETS, TEXTS, grc_model

import grace_st
from grace_st import MemoryFileError
from grace_st.files.adapter import LEARNED_STATE_RECORD
from grace_st.methods.grc import LATENT_FILE, MEMORY_DTYPES, LatentTokens

QUESTION = "What was it about?"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A saved tiny GRC model, loaded back, and a memory file of TEXTS it wrote (tensors, metadata)."""
    root = tmp_path_factory.mktemp("grc")
    grc_model().save(str(root / "model"))
    model = grace_st.load(str(root / "model"))
    grace_st.save_memories(root / "good.safetensors", grace_st.compress(model, TEXTS))
    with safe_open(str(root / "good.safetensors"), framework="pt") as file:
        metadata = file.metadata()
    tensors = load_file(root / "good.safetensors")
    return {"dir": root / "model", "model": model, "tensors": tensors, "metadata": metadata}


def error_line(err: str) -> str:
    """The CLI's one line of error, after any progress bar the model's loading drew."""
    return err.replace("\r", "\n").strip().splitlines()[-1]


def metadata_file(saved) -> tuple[dict, dict]:
    return dict(saved["tensors"]), dict(saved["metadata"])


def with_model_entry(**changes):
    """A file whose model entry says ``changes`` and whose tensors have the shape it then gives."""

    def edit(tensors, metadata):
        entry = {**json.loads(metadata["model"]), **changes}
        shape = (entry["layers"], entry["kv_heads"], entry["num_latent_tokens"], entry["head_dim"])
        tensors = {name: torch.zeros(shape, dtype=MEMORY_DTYPES[entry["dtype"]]) for name in tensors}
        positions = json.dumps([entry["num_latent_tokens"] + 10] * 2)
        return tensors, {**metadata, "model": json.dumps(entry), "next_positions": positions}

    return edit


def with_tensor(name, change):
    def edit(tensors, metadata):
        return {**tensors, name: change(tensors[name].clone())}, metadata

    return edit


def with_metadata(**changes):
    def edit(tensors, metadata):
        metadata = {**metadata, **changes}
        return tensors, {key: value for key, value in metadata.items() if value is not None}

    return edit


def without_tensor(name):
    return lambda tensors, metadata: ({k: v for k, v in tensors.items() if k != name}, metadata)


def with_positions(*positions):
    return with_metadata(next_positions=json.dumps(list(positions)))


def poison(value):
    def change(tensor):
        tensor.view(-1)[5] = value
        return tensor

    return change


def other_model(**kwargs):
    """A memory file written by another GRC model (m, layers or weights of its own)."""

    def edit(tensors, metadata, tmp_path):
        if "seed" in kwargs:
            tokenizer = make_tokenizer()
            model = grace_st.from_causal_lm(
                model=make_model(tokenizer, seed=kwargs["seed"]), tokenizer=tokenizer, device="cpu", method="grc",
                num_latent_tokens=3, max_rationale_tokens=dict(BUDGETS),
            )
        else:
            model = grc_model(**kwargs)
        grace_st.save_memories(tmp_path / "other.safetensors", grace_st.compress(model, TEXTS))
        with safe_open(str(tmp_path / "other.safetensors"), framework="pt") as file:
            return load_file(tmp_path / "other.safetensors"), file.metadata()

    edit.needs_path = True
    return edit


BAD_MEMORIES = {
    "another model's weights": (other_model(seed=1), "made by another model .*its weights_revision is"),
    "another model's m": (other_model(num_latent_tokens=4), "its num_latent_tokens is 4, this model's 3"),
    "another model's layers": (other_model(layers=3), "its layers is 3, this model's 2"),
    "m 1000": (with_model_entry(num_latent_tokens=1000), "its num_latent_tokens is 1000, this model's 3"),
    "40 layers": (with_model_entry(layers=40), "its layers is 40, this model's 2"),
    "float16 in the file": (with_model_entry(dtype="float16"), "its dtype is float16, this model's float32"),
    "int64 values": (with_tensor("memory.0.keys", lambda t: t.long()), "memory 0: its keys are int64, not float32"),
    "bool values": (with_tensor("memory.1.values", lambda t: t > 0), "memory 1: its values are bool, not float32"),
    "float16 values": (with_tensor("memory.0.keys", lambda t: t.half()), "its keys are float16, not float32"),
    "NaN": (with_tensor("memory.0.keys", poison(float("nan"))), "memory 0: its keys hold NaN or infinite values"),
    "inf": (with_tensor("memory.1.values", poison(float("inf"))), "memory 1: its values hold NaN or infinite"),
    "a shape of another model": (
        with_tensor("memory.0.keys", lambda t: t[:, :, :, :5].contiguous()), r"have shape \(2, 2, 3, 5\)"
    ),
    "next position -5": (with_positions(-5, 20), "memory 0: its next position is -5, not above m = 3"),
    "next position 0": (with_positions(20, 0), "memory 1: its next position is 0, not above m = 3"),
    "next position 2^62": (with_positions(2**62, 20), "its next position is 4611686018427387904, beyond the model's"),
    "next position 3.7": (with_positions(3.7, 20), "its next position is 3.7, not an integer"),
    "next position true": (with_positions(True, 20), "its next position is True, not an integer"),
    "next position '5'": (with_positions("5", 20), "its next position is '5', not an integer"),
    "next positions []": (with_positions(), "holds no memories"),
    "next positions not a list": (with_metadata(next_positions="5"), "next_positions is 5, not a list"),
    "next positions not JSON": (with_metadata(next_positions="[1,"), "next_positions is not JSON"),
    "no next positions": (with_metadata(next_positions=None), "no next_positions"),
    "no model entry": (with_metadata(model=None), "names no model that made it"),
    "a model entry lacking a field": (with_metadata(model='{"layers": 2}'), "its model entry is not an object of"),
    "no format": (with_metadata(format=None), "not a latent memory file"),
    "a tensor missing": (without_tensor("memory.1.values"), r"do not match its 2 next positions \(no memory.1.values"),
    "a tensor too many": (
        lambda tensors, metadata: ({**tensors, "memory.2.keys": tensors["memory.0.keys"].clone()}, metadata),
        "unexpected memory.2.keys",
    ),
}


def test_a_memory_stands_in_for_its_text_its_file_names_its_model_and_keeps_no_text_unless_asked(
    saved, tmp_path, capsys, monkeypatch
):
    path = tmp_path / "mem.safetensors"
    argv = ["compress", *TEXTS, "--model", str(saved["dir"]), "--out", str(path)]
    code, out, err = run_cli(argv, capsys, monkeypatch)
    assert code == 0 and "2 memories of" in out, err
    with safe_open(str(path), framework="pt") as file:
        metadata = file.metadata()
    assert set(metadata) == {"format", "model", "next_positions"}
    assert all(text.encode() not in path.read_bytes() for text in TEXTS)
    entry = json.loads(metadata["model"])
    assert entry == {
        "weights_revision": saved["model"][0].weights_revision, "num_latent_tokens": 3, "layers": 2, "kv_heads": 2,
        "head_dim": 8, "dtype": "float32",
    }
    kept = tmp_path / "kept.safetensors"
    argv = ["compress", *TEXTS, "--model", str(saved["dir"]), "--out", str(kept), "--keep-texts"]
    assert run_cli(argv, capsys, monkeypatch)[0] == 0
    with safe_open(str(kept), framework="pt") as file:
        assert json.loads(file.metadata()["texts"]) == TEXTS
    memories = grace_st.compress(saved["model"], TEXTS)
    grace_st.save_memories(tmp_path / "python.safetensors", memories)
    with safe_open(str(tmp_path / "python.safetensors"), framework="pt") as file:
        assert "texts" not in file.metadata()
    # the memories of an in-memory model are read by the same model saved and loaded back
    in_memory = grc_model()
    grace_st.save_memories(tmp_path / "before.safetensors", grace_st.compress(in_memory, TEXTS))
    in_memory.save(str(tmp_path / "model"))
    argv = ["ask", QUESTION, "--model", str(tmp_path / "model"), "--memory", str(tmp_path / "before.safetensors"),
            "--max-new-tokens", "3"]
    assert run_cli(argv, capsys, monkeypatch)[0] == 0


@pytest.mark.parametrize("case", BAD_MEMORIES, ids=list(BAD_MEMORIES))
def test_a_memory_the_model_cannot_read_is_refused_naming_the_file_and_the_problem(
    saved, tmp_path, capsys, monkeypatch, case
):
    edit, problem = BAD_MEMORIES[case]
    tensors, metadata = metadata_file(saved)
    tensors, metadata = edit(tensors, metadata, tmp_path) if hasattr(edit, "needs_path") else edit(tensors, metadata)
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(MemoryFileError, match=problem) as refused:
        grace_st.answer(saved["model"], QUESTION, grace_st.load_memories(path), max_new_tokens=2)
    assert str(refused.value).startswith(str(path))
    argv = ["ask", QUESTION, "--model", str(saved["dir"]), "--memory", str(path), "--max-new-tokens", "2"]
    code, out, err = run_cli(argv, capsys, monkeypatch)
    assert code == 2 and out == ""
    assert error_line(err).startswith(f"grace-st ask: error: {path}") and "Traceback" not in err


@pytest.mark.parametrize("kind", ["directory", "FIFO", "missing"])
def test_a_memory_path_that_is_no_regular_file_is_refused_at_once(saved, tmp_path, capsys, monkeypatch, kind):
    path = tmp_path / "memory"
    if kind == "directory":
        path.mkdir()
    elif kind == "FIFO":
        os.mkfifo(path)
    expected = {"directory": "a directory, not a regular file", "FIFO": "a named pipe", "missing": "cannot be read"}
    with deadline(30):  # a FIFO once waited for a writer forever
        with pytest.raises(MemoryFileError, match=expected[kind]):
            grace_st.load_memories(path)
        argv = ["ask", QUESTION, "--model", str(saved["dir"]), "--memory", str(path)]
        code, _, err = run_cli(argv, capsys, monkeypatch)
    assert code == 2 and err.startswith(f"grace-st ask: error: {path}: ") and expected[kind] in err


def test_memories_built_by_hand_are_checked_against_the_reading_model(saved):
    [memory] = grace_st.compress(saved["model"], TEXTS[:1])
    memory.model = None  # no identity to compare: the shapes, values and position still are
    memory.next_position = -1
    with pytest.raises(MemoryFileError, match="memory 0: its next position is -1"):
        grace_st.answer(saved["model"], QUESTION, [memory])
    with pytest.raises(MemoryFileError, match="names no model"):
        grace_st.save_memories("unused.safetensors", [memory])


def test_compress_refuses_an_existing_out_unless_overwrite_and_writes_in_one_step(saved, tmp_path, capsys, monkeypatch):
    path = tmp_path / "notes.safetensors"
    path.write_bytes(b"a user's own file")
    argv = ["compress", *TEXTS, "--model", str(saved["dir"]), "--out", str(path)]
    code, _, err = run_cli(argv, capsys, monkeypatch)
    assert code == 2 and f"{path}: exists" in err and err.count("\n") == 1
    assert path.read_bytes() == b"a user's own file"
    memories = grace_st.compress(saved["model"], TEXTS)
    with pytest.raises(MemoryFileError, match="exists"):
        grace_st.save_memories(path, memories)
    assert run_cli([*argv, "--overwrite"], capsys, monkeypatch)[0] == 0
    assert len(grace_st.load_memories(path)) == 2

    import safetensors.torch

    def interrupted(tensors, filename, metadata=None):
        with open(filename, "wb") as handle:
            handle.write(b"half a file")
        raise KeyboardInterrupt

    before = path.read_bytes()
    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        grace_st.save_memories(path, memories, overwrite=True)
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["notes.safetensors"]


def files_of(folder) -> dict[str, bytes]:
    return {entry: (folder / entry).read_bytes() for entry in os.listdir(folder) if (folder / entry).is_file()}


@pytest.mark.parametrize(
    "target", ["adapter_model.safetensors", "adapter_config.json", "a new file", "model.safetensors", "latents"]
)
def test_compress_never_writes_into_a_model_folder(saved, tmp_path, capsys, monkeypatch, target):
    if target in ("model.safetensors", "latents"):
        folder = saved["dir"]
    else:
        _, folder = adapter_model(tmp_path)
    name = {"a new file": "memories.safetensors", "latents": LATENT_FILE}.get(target, target)
    before = files_of(folder)
    for overwrite in ([], ["--overwrite"]):
        argv = ["compress", TEXTS[0], "--model", str(saved["dir"]), "--out", str(folder / name), *overwrite]
        code, _, err = run_cli(argv, capsys, monkeypatch)
        assert code == 2 and f"{folder} holds a model" in err and "never written into a model's folder" in err
    assert files_of(folder) == before
    grace_st.load(str(folder))  # still loads


def test_compress_names_itself_for_bad_stdin_and_refuses_no_texts(saved, capsys, monkeypatch, tmp_path):
    argv = ["compress", "-", "--model", str(saved["dir"]), "--out", str(tmp_path / "m.safetensors")]
    code, _, err = run_cli(argv, capsys, monkeypatch, stdin=b"fine\nbad \xff byte\n")
    assert code == 1 and "grace-st compress: stdin line 2 is not valid UTF-8" in err
    code, _, err = run_cli(argv, capsys, monkeypatch, stdin=b"")
    assert code == 1 and "grace-st compress: no texts to compress" in err
    assert not (tmp_path / "m.safetensors").exists()


def grc_adapter(tmp_path):
    """A tiny GRC model saved as a base and a (random, non-zero) LoRA adapter beside its latents."""
    return adapter_model(
        tmp_path, folder="grc-lora", method="grc", num_latent_tokens=3, max_rationale_tokens=dict(BUDGETS)
    )


def edit_latents(path):
    latents = LatentTokens.load(path)
    with torch.no_grad():
        latents.latents.add_(1.0)
    latents.save(path)


def edit_adapter(path):
    weights = load_file(path / "adapter_model.safetensors")
    name = next(key for key in sorted(weights) if "lora_B" in key)
    weights[name] = weights[name] + 0.1
    save_file(weights, str(path / "adapter_model.safetensors"))


EDITS = {
    "latents edited": (edit_latents, ValueError, f"{LATENT_FILE}: not the file the model was saved with"),
    "adapter weights edited": (edit_adapter, ValueError, "adapter_model.safetensors: not the file the model was saved"),
    "rank edited": (
        lambda path: (path / "adapter_config.json").write_text(
            json.dumps({**json.loads((path / "adapter_config.json").read_text()), "lora_alpha": 16})
        ),
        ValueError, "adapter_config.json: not the file",
    ),
    "latents removed": (lambda path: (path / LATENT_FILE).unlink(), FileNotFoundError, "missing, though"),
    "a learned file added": (
        lambda path: save_file({"x": torch.zeros(2)}, str(path / "extra.safetensors")), ValueError, "not in learned"
    ),
}


@pytest.mark.parametrize("edit", EDITS, ids=list(EDITS))
def test_an_adapter_folders_learned_state_edited_after_saving_is_refused_at_load(tmp_path, edit):
    _, path = grc_adapter(tmp_path)
    assert (path / LATENT_FILE).is_file() and (path / LEARNED_STATE_RECORD).is_file()
    change, error, match = EDITS[edit]
    change(path)
    with pytest.raises(error, match=match):
        grace_st.load(str(path))


def test_an_adapter_folder_as_saved_loads_with_its_base_moved_and_without_a_record(tmp_path):
    model, path = grc_adapter(tmp_path)
    expected = model.encode(TEXTS, convert_to_tensor=True)
    loaded = grace_st.load(str(path)).encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(loaded, expected, atol=1e-5, rtol=1e-4)
    os.rename(tmp_path / "base", tmp_path / "moved")  # where the base lies is no learned state
    config = json.loads((path / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "moved")
    (path / "adapter_config.json").write_text(json.dumps(config))
    torch.testing.assert_close(grace_st.load(str(path)).encode(TEXTS, convert_to_tensor=True), loaded, atol=0, rtol=0)
    (path / LEARNED_STATE_RECORD).unlink()  # a folder without the record (PEFT's own save writes none): not checked
    edit_latents(path)
    assert grace_st.load(str(path))[0].method == "grc"
