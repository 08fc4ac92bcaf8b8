"""grace_st.load and GenerativeEncoder.load: no code from the model runs unless asked, and weights
that do not belong to their config are refused."""

import json
import shutil

import pytest
import torch
from conftest import make_st_model
from safetensors.torch import load_file, save_file

import grace_st
from grace_st.cli import main
from grace_st.files.loading import RemoteCodeError

TEXTS = ["The cat sat on the mat.", "Stock markets fell."]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "grace"
    make_st_model().save(str(path))
    return path


def _copy(saved, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(saved, target)
    return target


def _plant_code(directory, marker):
    """A .py file that, if imported, leaves ``marker`` behind: the proof that code ran. Its classes
    are subclasses: transformers marks a class loaded through an auto_map as custom, which must
    not happen to its own LlamaForCausalLM for the rest of the session."""
    (directory / "planted.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from sentence_transformers.models import Normalize\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class Planted(Normalize): pass\n"
        "class PlantedConfig(LlamaConfig): pass\n"
        "class PlantedModel(LlamaForCausalLM):\n"
        "    config_class = PlantedConfig\n"
    )


def test_our_own_model_loads_without_asking_for_remote_code(saved):
    model = grace_st.load(str(saved), device="cpu")
    assert type(model[0]).__name__ == "GenerativeEncoder"
    assert model.encode(TEXTS).shape[0] == 2


def test_a_module_class_shipped_with_the_model_is_refused_and_never_imported(saved, tmp_path):
    model_dir, marker = _copy(saved, tmp_path), tmp_path / "ran"
    _plant_code(model_dir, marker)
    modules = json.loads((model_dir / "modules.json").read_text())
    modules[-1]["type"] = "planted.Planted"
    (model_dir / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(RemoteCodeError, match=r"modules\.json names the module class 'planted\.Planted'"):
        grace_st.load(str(model_dir), device="cpu")
    assert main(["encode", "--model", str(model_dir), *TEXTS]) == 1
    assert not marker.exists()


def test_an_auto_map_is_refused_by_the_loader_and_never_followed_by_the_module(saved, tmp_path):
    """``load`` refuses it by name; ``SentenceTransformer(path, trust_remote_code=True)`` (the flag
    sentence-transformers 6 needs for our class) no longer passes the flag on to transformers, so the
    model's config is read as the built-in architecture and the planted file never runs."""
    from sentence_transformers import SentenceTransformer

    model_dir, marker = _copy(saved, tmp_path), tmp_path / "ran"
    _plant_code(model_dir, marker)
    config = json.loads((model_dir / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "planted.PlantedConfig", "AutoModelForCausalLM": "planted.PlantedModel"}
    (model_dir / "config.json").write_text(json.dumps(config))
    settings = json.loads((model_dir / "grace_config.json").read_text())
    settings["weights_revision"] = None  # as saved by its author, auto_map included
    (model_dir / "grace_config.json").write_text(json.dumps(settings))
    with pytest.raises(RemoteCodeError, match=r"config\.json has an auto_map"):
        grace_st.load(str(model_dir), device="cpu")
    loaded = SentenceTransformer(str(model_dir), device="cpu", trust_remote_code=True)
    assert type(loaded[0].model).__name__ == "LlamaForCausalLM"
    assert not marker.exists()
    # asked for explicitly, the code is the user's choice and runs
    grace_st.load(str(model_dir), device="cpu", trust_remote_code=True)
    assert marker.exists()


def test_weights_that_do_not_fit_their_config_are_refused(saved, tmp_path):
    """A config.json of another width beside our weights: transformers would initialise at random."""
    model_dir = _copy(saved, tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config["hidden_size"], config["intermediate_size"] = 48, 96
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json and the weights do not belong together"):
        grace_st.load(str(model_dir), device="cpu")
    config = json.loads((saved / "config.json").read_text())
    config["num_hidden_layers"] += 1  # one layer more than the checkpoint holds
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="weights the config asks for are not in the checkpoint"):
        grace_st.load(str(model_dir), device="cpu")


def test_weights_changed_after_saving_are_refused_by_their_saved_revision(saved, tmp_path):
    model_dir = _copy(saved, tmp_path)
    weights = load_file(model_dir / "model.safetensors")
    name = min(weights)
    weights[name] = weights[name] + 0.01
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="not the ones grace_config.json was saved with"):
        grace_st.load(str(model_dir), device="cpu")
    config = json.loads((saved / "config.json").read_text())
    config["rms_norm_eps"] = 0.5  # same shapes, another network
    shutil.copy(saved / "model.safetensors", model_dir / "model.safetensors")
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="weights_revision"):
        grace_st.load(str(model_dir), device="cpu")
    # loading in another dtype converts the weights on purpose: not checked
    shutil.copy(saved / "config.json", model_dir / "config.json")
    grace_st.load(str(model_dir), device="cpu", model_kwargs={"dtype": torch.bfloat16})


def _plant_module(path, marker):
    """A module file that, if imported, leaves ``marker`` behind and defines ``Evil``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "import pathlib\n"
        f"pathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from sentence_transformers.models import Normalize\n"
        "class Evil(Normalize): pass\n"
    )


@pytest.mark.parametrize(
    "reference, planted",
    [
        # transformers' dynamic loader reads "grace_st.Evil" as class Evil of <model folder>/grace_st.py
        ("grace_st.Evil", "model/grace_st.py"),
        # and "grace_st.x--evil.Evil" as class Evil of ./grace_st.x/evil.py, from the working directory
        ("grace_st.x--evil.Evil", "grace_st.x/evil.py"),
        # an exact class of ours, with a file in the model folder the dynamic loader could take instead
        ("grace_st.encoder.GenerativeEncoder", "model/grace_st.py"),
    ],
)
def test_a_reference_that_only_starts_with_grace_st_is_refused_and_its_code_never_runs(
    saved, tmp_path, monkeypatch, capsys, reference, planted
):
    model_dir, marker = _copy(saved, tmp_path), tmp_path / "ran"
    _plant_module(tmp_path / planted, marker)
    modules = json.loads((model_dir / "modules.json").read_text())
    modules[0]["type"] = reference
    (model_dir / "modules.json").write_text(json.dumps(modules))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RemoteCodeError, match=rf"modules\.json names the module class '{reference}' \("):
        grace_st.load("model", device="cpu")
    assert main(["encode", "--model", "model", *TEXTS]) == 1
    assert "names the module class" in capsys.readouterr().err
    assert not marker.exists()


def test_only_exact_classes_of_the_installed_packages_pass():
    from grace_st.files.loading import module_class_problem

    assert module_class_problem("grace_st.encoder.GenerativeEncoder") is None
    assert module_class_problem("sentence_transformers.models.Normalize") is None  # an old path, still installed
    for reference, why in [
        ("grace_st.GenerativeEncoder", "grace_st.py in the model folder"),
        ("grace_st.nowhere.Evil", "no module grace_st.nowhere"),
        ("grace_st.encoder.Evil", "has no class Evil"),
        ("grace_st.settings.Mapping", "not defined in the installed package"),
        ("grace_st.encoder--x.Evil", "'--'"),
        ("grace_st.model_cards.__main__.Card", "not a dotted path"),
        ("planted.Planted", "not a class of the installed"),
    ]:
        assert why in module_class_problem(reference), reference


def test_nothing_but_the_loader_passes_trust_remote_code_true():
    """``trust_remote_code=True`` given to sentence-transformers or transformers anywhere but
    grace_st/files/loading.py would reopen the door the loader closes (read from the source, comments
    and docstrings aside: a keyword argument or a dict entry set to True)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    found = []
    for folder in ("grace_st", "grace_training", "benchmarks"):
        for path in sorted((root / folder).rglob("*.py")):
            if path == root / "grace_st" / "loading.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                pairs = []
                if isinstance(node, ast.Call):
                    pairs = [(keyword.arg, keyword.value) for keyword in node.keywords]
                elif isinstance(node, ast.Dict):
                    pairs = [(key.value if isinstance(key, ast.Constant) else None, value)
                             for key, value in zip(node.keys, node.values)]
                for name, value in pairs:
                    if name == "trust_remote_code" and isinstance(value, ast.Constant) and value.value is True:
                        found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, f"trust_remote_code=True outside grace_st/files/loading.py: {found}"
