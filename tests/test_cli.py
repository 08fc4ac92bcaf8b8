import io
import json

import pytest
from conftest import make_model, make_st_model

from grace_st.cli import main


@pytest.fixture
def saved_model(tmp_path):
    path = str(tmp_path / "model")
    make_st_model(max_rationale_tokens=4).save(path)
    return path


def test_encode_prints_rationales_and_similarities(saved_model, capsys):
    assert main(["encode", "The cat sat.", "Markets fell.", "--model", saved_model]) == 0
    out = capsys.readouterr().out
    assert "[0] The cat sat." in out and "rationale" in out and "cosine similarity" in out
    assert " 1.000" in out


def test_encode_json_from_stdin(saved_model, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("first text\n\nsecond text\n"))
    assert main(["encode", "-", "--model", saved_model, "--json", "--max-rationale-tokens", "2"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["texts"] == ["first text", "", "second text"]  # a blank line is an empty text: rows align
    assert len(payload["rationales"]) == 3 and len(payload["embeddings"][0]) == 32
    assert abs(payload["similarity"][0][0] - 1.0) < 1e-5


def test_encode_with_a_rationale_cache(saved_model, capsys, tmp_path):
    cache = tmp_path / "cache.sqlite"
    argv = ["encode", "a text", "another", "--model", saved_model, "--json", "--cache", str(cache)]
    assert main(argv) == 0
    cold = json.loads(capsys.readouterr().out)
    assert cache.is_file()
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out) == cold


def test_build_from_a_causal_lm(tmp_path, tokenizer, capsys):
    from sentence_transformers import SentenceTransformer

    lm = tmp_path / "lm"
    make_model(tokenizer).save_pretrained(lm)
    tokenizer.save_pretrained(lm)
    out = tmp_path / "grace"
    assert main(["build", "--base", str(lm), "--out", str(out), "--max-rationale-tokens", "3", "--query-instruction", "Q?"]) == 0
    model = SentenceTransformer(str(out), device="cpu", trust_remote_code=True)
    assert model[0].max_rationale_tokens == 3 and model[0].instructions["query"] == "Q?"
    assert "saved a GRACE model (32-d)" in capsys.readouterr().out
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: sentence-transformers\npipeline_tag: sentence-similarity")
    assert f"base_model: {lm}" in card and "trust_remote_code=True" in card and "`max_rationale_tokens` | `3`" in card


def test_the_settings_table_feeds_config_keys_the_cache_key_and_the_cli():
    """One source: every saved setting is in grace_st.settings.SETTINGS, the rationale cache keys by
    the ones it marks, and each one it marks as a CLI option is an option of `encode` and `build`."""
    from grace_st import GenerativeEncoder
    from grace_st.cache import REQUIRED_SETTINGS
    from grace_st.cli import build_parser
    from grace_st.settings import RATIONALE_SETTINGS, SETTINGS

    assert GenerativeEncoder.config_keys == list(SETTINGS)
    assert [name for name in REQUIRED_SETTINGS if name in SETTINGS] == list(RATIONALE_SETTINGS)
    assert set(RATIONALE_SETTINGS) == {n for n, s in SETTINGS.items() if s.decides_rationale}
    commands = build_parser()._subparsers._group_actions[0].choices
    for command in ("encode", "build"):
        options = {action.dest for action in commands[command]._actions}
        assert {n for n, s in SETTINGS.items() if s.cli_option} <= options, command
        assert not {n for n, s in SETTINGS.items() if not s.cli_option} & options, command
        helps = {action.dest: action.help for action in commands[command]._actions}
        assert all(helps[n].startswith(s.help) for n, s in SETTINGS.items() if s.cli_option), command


def test_each_setting_has_its_default_once_and_the_usage_table_is_the_code():
    """A setting's default lives in SETTINGS alone: the constructor's signature reads it, a saved config holds
    it, and docs/usage.md's table is generated from the table (python -m grace_st.settings)."""
    import inspect
    from pathlib import Path

    from grace_st import GenerativeEncoder
    from grace_st.settings import SETTINGS, settings_table

    signature = inspect.signature(GenerativeEncoder.__init__).parameters
    for name, setting in SETTINGS.items():
        # None: a fresh copy of the default, or the method's budget (settings.default_budget)
        expected = None if name in ("instructions", "max_rationale_tokens") else setting.default
        assert signature[name].default == expected, name
        assert f"{name}: {setting.help}" in " ".join(GenerativeEncoder.__doc__.split()), name
    usage = (Path(__file__).parents[1] / "docs" / "usage.md").read_text(encoding="utf-8")
    start = usage.index("\n", usage.index("<!-- settings table")) + 1
    end = usage.index("<!-- end of settings table -->")
    assert usage[start:end] == settings_table(), "docs/usage.md's settings table is stale: python -m grace_st.settings"


def test_encode_shows_the_similarity_matrix_only_for_a_few_texts_or_on_request(saved_model, capsys, monkeypatch):
    """N texts make an N × N matrix: 6,000 stdin lines would be hundreds of MB of JSON. Over 32 texts
    it is left out unless --similarity asks for it (and --no-similarity leaves it out at any N)."""
    from grace_st import cli

    many = [f"text {index}" for index in range(cli.SIMILARITY_MAX_TEXTS + 1)]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(many) + "\n"))
    base = ["encode", "-", "--model", saved_model, "--max-rationale-tokens", "0", "--batch-size", "64"]
    assert main([*base, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert len(payload["embeddings"]) == len(many) and "similarity" not in payload
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(many) + "\n"))
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "cosine similarity" not in out and "--similarity prints it" in out
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(many) + "\n"))
    assert main([*base, "--json", "--similarity"]) == 0
    assert len(json.loads(capsys.readouterr().out)["similarity"]) == len(many)
    assert main(["encode", "a", "b", "--model", saved_model, "--json", "--no-similarity", "--max-rationale-tokens", "0"]) == 0
    assert "similarity" not in json.loads(capsys.readouterr().out)
    assert "--similarity" in cli.build_parser()._subparsers._group_actions[0].choices["encode"].format_help()


@pytest.mark.parametrize("where", ["missing folder", "a directory"])
def test_eval_refuses_an_unwritable_output_before_the_evaluation(saved_model, tmp_path, capsys, monkeypatch, where):
    pytest.importorskip("mteb")
    from grace_st import cli

    table = tmp_path / "sts.tsv"
    table.write_text("score\tsentence1\tsentence2\n" + "".join(f"{i}\ta {i}\tb {i}\n" for i in range(5)))
    output = tmp_path / "no" / "such" / "results.json" if where == "missing folder" else tmp_path

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before --output was checked")

    monkeypatch.setattr(cli, "_load_model", never)
    argv = ["eval", saved_model, "--sts", str(table), "--output", str(output), "--cache-dir", str(tmp_path / "cache")]
    with pytest.raises(SystemExit, match=r"--output .* (cannot be written|is a directory)"):
        main(argv)
    writable = tmp_path / "results.json"
    cli._check_writable(str(writable))
    assert not writable.exists()  # the check leaves no file behind
