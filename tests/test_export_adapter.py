"""grace_training.tools.export_adapter: the package's adapter is replaced only on request, only by one that
fits the shipped base, and whole; ``default_model_path`` refuses an adapter its manifest disowns.

The package's own directories are never touched: ``ADAPTER_DIRS`` points at temporary copies."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import make_st_model
from safetensors.torch import load_file, save_file

from grace_st import default_model as dm
from grace_training.config.train_config import TrainConfig
from grace_training.tools.export_adapter import export, main


def _checkpoint(path, adapter_weights=None):
    """A LoRA checkpoint as export reads it: the adapter (a tiny model's, or ``adapter_weights``
    copied in), the encoder settings and the trainer state."""
    from peft import LoraConfig, get_peft_model

    lm = get_peft_model(make_st_model()[0].model, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    lm.save_pretrained(path)
    if adapter_weights is not None:
        shutil.copyfile(adapter_weights, path / "adapter_model.safetensors")
    (path / "grace_config.json").write_text(json.dumps({"instructions": {"default": "Think."}, "max_rationale_tokens": 4}))
    (path / "trainer_state").mkdir()
    state = {"config": TrainConfig(finetune="lora").to_dict(), "step": 7}
    (path / "trainer_state" / "state.json").write_text(json.dumps(state))
    return path


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A copy of the shipped GRACE adapter standing in for the package's directory."""
    copy = tmp_path / "package" / "default_adapter"
    shutil.copytree(dm.ADAPTER_DIRS["grace"], copy)
    monkeypatch.setitem(dm.ADAPTER_DIRS, "grace", copy)
    return copy


def _contents(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_an_export_names_its_target(tmp_path, package, capsys):
    checkpoint = _checkpoint(tmp_path / "checkpoint")
    before = _contents(package)
    with pytest.raises(SystemExit):
        main([str(checkpoint)])
    assert "give --out DIR, or --into-package" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="is the package's adapter, which every default model builds from: pass --into-package"):
        main([str(checkpoint), "--out", str(package)])
    assert _contents(package) == before


def test_an_adapter_that_does_not_fit_the_shipped_base_is_refused_for_the_package(tmp_path, package):
    checkpoint = _checkpoint(tmp_path / "checkpoint")  # a 32-wide test model's adapter
    before = _contents(package)
    with pytest.raises(SystemExit, match="must fit the shipped base, HuggingFaceTB/SmolLM2-135M-Instruct"):
        main([str(checkpoint), "--into-package"])
    assert _contents(package) == before
    assert export(checkpoint, tmp_path / "elsewhere").is_dir()  # anywhere else it is the user's business


def test_into_the_package_a_fitting_adapter_is_swapped_in_whole_with_its_manifest(tmp_path, package):
    checkpoint = _checkpoint(tmp_path / "checkpoint", adapter_weights=package / "adapter_model.safetensors")
    shipped = json.loads((package / dm.ADAPTER_SETTINGS).read_text())
    budget_choice, budgets = shipped["budget_choice"], shipped["encoder"]["max_rationale_tokens"]
    assert main([str(checkpoint), "--into-package"]) == 0
    assert sorted(p.name for p in package.iterdir()) == sorted(
        ["adapter_config.json", "adapter_model.safetensors", dm.ADAPTER_SETTINGS, dm.ADAPTER_MANIFEST]
    )
    settings = json.loads((package / dm.ADAPTER_SETTINGS).read_text())
    assert settings["training"]["step"] == 7 and settings["budget_choice"] == budget_choice
    assert settings["encoder"]["max_rationale_tokens"] == budgets  # chosen by the budget study, kept with its account
    dm.verify_adapter(package)
    assert [p.name for p in package.parent.iterdir()] == ["default_adapter"]  # nothing left beside it


def test_a_kill_mid_export_leaves_the_old_adapter(tmp_path, package, monkeypatch):
    from grace_training.tools import export_adapter

    checkpoint = _checkpoint(tmp_path / "checkpoint", adapter_weights=package / "adapter_model.safetensors")
    before = _contents(package)

    def killed(checkpoint, out, adapter, *args):
        shutil.copyfile(adapter, out / "adapter_model.safetensors")
        raise KeyboardInterrupt

    monkeypatch.setattr(export_adapter, "_write", killed)
    with pytest.raises(KeyboardInterrupt):
        main([str(checkpoint), "--into-package"])
    assert _contents(package) == before
    assert [p.name for p in package.parent.iterdir()] == ["default_adapter"]


def test_an_out_directory_holding_other_files_is_not_replaced(tmp_path):
    checkpoint = _checkpoint(tmp_path / "checkpoint")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="holds notes.txt, which is no exported adapter's"):
        export(checkpoint, tmp_path / "runs")
    assert (tmp_path / "runs" / "notes.txt").read_text() == "mine"
    out = export(checkpoint, tmp_path / "adapter")
    assert export(checkpoint, out) == out  # an exported adapter is replaced by the next export
    dm.verify_adapter(out)


def test_a_mixed_or_truncated_adapter_is_refused_before_the_default_is_built(tmp_path, package, monkeypatch):
    def never(home=None):
        raise AssertionError("the base was built for an adapter that fails its manifest")

    monkeypatch.setattr(dm, "_base_model_path", never)
    weights = load_file(package / "adapter_model.safetensors")
    name = min(weights)
    weights[name] = weights[name] * 2  # another export's weights beside this one's config and settings
    save_file(weights, package / "adapter_model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors: sha256 .* is not the .* manifest\.json records"):
        dm.default_model_path(tmp_path / "home")
    (package / "adapter_model.safetensors").write_bytes(b"")  # cut short
    with pytest.raises(ValueError, match="mixed or truncated"):
        dm.default_model_path(tmp_path / "home")
    (package / dm.ADAPTER_MANIFEST).unlink()
    with pytest.raises(ValueError, match=r"manifest\.json: missing"):
        dm.default_model_path(tmp_path / "home")


def test_the_manifest_is_regenerated_on_request_and_the_shipped_ones_hold(tmp_path, package, capsys):
    for directory in dm.ADAPTER_DIRS.values():
        if directory.is_dir():  # a method the package ships no adapter for is refused by name (test_default_model)
            dm.verify_adapter(directory)
    settings = json.loads((package / dm.ADAPTER_SETTINGS).read_text())
    settings["encoder"]["max_rationale_tokens"] = {"query": 16, "document": 0, "default": 16}
    (package / dm.ADAPTER_SETTINGS).write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="grace_settings.json: sha256"):
        dm.verify_adapter(package)
    assert main(["--write-manifest", str(package)]) == 0
    dm.verify_adapter(package)
    # the trained directory's name hashes the adapter's own files: a manifest changes nothing there
    revision = dm.shipped_adapter_revision(package)
    (package / dm.ADAPTER_MANIFEST).write_text("{}")
    assert dm.shipped_adapter_revision(package) == revision
