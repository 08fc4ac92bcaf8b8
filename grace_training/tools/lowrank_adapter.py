"""A fully fine-tuned GRACE model as a LoRA adapter on its base: the shippable form of a full fine-tuning.

The package ships adapters on the embedded base (``grace_st/adapters/default``, at most 20 MiB), so a model trained
with ``finetune: full`` (or a LoRA stage on top of one, decisions/D028) ships only as a low-rank approximation of
its weight delta. Each linear layer of the decoder gets ΔW = W_tuned − W_base cut to rank r, written as PEFT's
``lora_B @ lora_A`` (``lora_alpha = r``, so the scaling is 1):

- plain: the truncated SVD of ΔW, the rank-r matrix nearest ΔW (Eckart–Young);
- ``calibration`` > 0 (the default): the rank-r matrix that moves the layer's *outputs* least on real prompts,
  min ‖(ΔW − ΔW_r) X‖ over the inputs X the tuned layer sees when it encodes texts of the training data (their
  prompts and rationales, as ``encode`` runs them). With the inputs' Gram matrix C = X Xᵀ = L Lᵀ that is the SVD of
  ΔW L cut to rank r and mapped back by L⁻¹ (as in SVD-LLM, Wang et al. 2024). Directions the inputs never take
  cost nothing to drop.

Each layer's cut is the best one for that layer alone. ``--distill-steps N`` then trains the cut's factors for N steps
toward what the tuned model's whole stack computes: the hidden states ``encode`` pools (Eq. 3) at every position of
the calibration sequences (:func:`distill`).

    python -m grace_training.tools.lowrank_adapter runs/yl_grace/checkpoint-00000100 --rank 32 --out runs/yl_lowrank32 \
        --config grace_training/configs/scale_grace.yaml --distill-steps 200 --distill-learning-rate 5e-5

A GRC model's latent tokens and adapter A are carried whole (``latent_tokens.safetensors``); its cut is the plain
SVD (its embedding reads the latents, which the calibration sequences leave out).

The output is a saved GRACE adapter model on the base (``dev_eval.py PATH@saved`` scores it,
``export_adapter PATH --bfloat16`` ships it), with the tuned model's encoder settings and ``lowrank_from.json``: what
it approximates and how much of the delta each kind of layer kept. The tuned model's embeddings and norm weights
are not carried (the base's stay); the summary reports their share of the delta.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import shutil
import sys
from pathlib import Path

import torch

LOWRANK_FROM = "lowrank_from.json"
# every linear layer of a decoder block; the LM head is tied to the embeddings, which are not carried
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def delta_spectrum(
    delta: torch.Tensor, gram: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(u, s, right)`` in float64 with ``delta = u diag(s) right``, terms in the order a cut keeps them: the rank-r
    cut is the first r. Without ``gram`` the SVD of ``delta`` (out × in); with ``gram`` (the layer's input Gram matrix,
    in × in) the SVD of ``delta L`` mapped back by L⁻¹, so the first r terms are the rank-r delta nearest in the
    layer's outputs on those inputs."""
    delta = delta.double()
    if gram is None:
        return torch.linalg.svd(delta, full_matrices=False)
    gram = gram.double()
    # damping: a direction no calibration input took must not blow up L⁻¹
    gram = gram + 1e-4 * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype)
    lower = torch.linalg.cholesky(gram)
    u, s, vh = torch.linalg.svd(delta @ lower, full_matrices=False)
    # right = vh L⁻¹, i.e. the solution X of X L = vh
    return u, s, torch.linalg.solve_triangular(lower, vh, upper=False, left=False)


def lowrank_factors(
    delta: torch.Tensor, rank: int, gram: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` with ``B @ A`` the rank-``rank`` cut of ``delta`` (:func:`delta_spectrum`). Each term's row of A and
    column of B get one norm, so neither factor is far larger than the other: the input-fitted ``right`` rows are
    not unit vectors, and factors of very different scales would train badly under one learning rate
    (:func:`distill`)."""
    u, s, right = delta_spectrum(delta, gram)
    u, s, right = u[:, :rank], s[:rank], right[:rank]
    # u's columns are unit vectors: B's column norm is `norm`, A's row norm s ‖right‖ / norm, equal by this choice
    norm = (s * right.norm(dim=1)).sqrt().clamp(min=torch.finfo(torch.float64).tiny)
    return ((s / norm)[:, None] * right).float(), (u * norm).float()


class InputGrams:
    """Σ x xᵀ over every input row each target linear layer sees while hooked (float64)."""

    def __init__(self, model: torch.nn.Module, names: list[str]):
        self.grams: dict[str, torch.Tensor] = {}
        self.tokens = 0
        modules = dict(model.named_modules())
        self._hooks = [modules[name].register_forward_hook(self._hook(name)) for name in names]

        self._last: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    def _hook(self, name: str):
        def accumulate(module, inputs, output):
            last_input, gram = self._last
            if inputs[0] is not last_input:  # q/k/v (and gate/up) read one tensor: one product for the three
                rows = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
                gram = rows.T @ rows
                self._last = (inputs[0], gram)
            self.grams[name] = self.grams[name] + gram if name in self.grams else gram.clone()

        return accumulate

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def calibration_texts(config: Path, count: int, seed: int) -> list[tuple[str, list[str]]]:
    """``count`` training instances of a ``grace-train`` config, as (prompt type, texts) groups: each instance's
    query and positive, by the roles training encodes them with (a symmetric pair: both ``default``)."""
    import yaml

    from grace_training.data.examples import load_data

    settings = yaml.safe_load(config.read_text(encoding="utf-8"))
    rows, _ = load_data(settings["train_data"], data_dir=settings.get("data_dir"), seed=seed)
    rows = random.Random(seed).sample(rows, min(count, len(rows)))
    groups: dict[str, list[str]] = {"default": [], "query": [], "document": []}
    for row in rows:
        groups["default" if row.symmetric else "query"].append(row.query)
        groups["default" if row.symmetric else "document"].append(row.positive)
    return [(kind, texts) for kind, texts in groups.items() if texts]


@torch.no_grad()
def encoded_sequences(
    model, groups: list[tuple[str, list[str]]], batch_size: int = 16
) -> list[tuple[torch.Tensor, int]]:
    """Each text's prompt followed by the rationale the model writes for it, the tokens ``encode`` runs through the
    LM for that text (Eq. 3's sequence), with its instruction span L_sys (Eq. 3 pools the positions after it)."""
    from tqdm.auto import tqdm

    encoder = model[0]
    sequences = []
    batches = [(kind, texts[i : i + batch_size]) for kind, texts in groups for i in range(0, len(texts), batch_size)]
    for kind, batch in tqdm(batches, desc="calibration rationales", unit="batch"):
        features = encoder.preprocess(batch, task=kind)
        out = encoder.forward(features, task=kind)
        rows = zip(
            features["input_ids"],
            features["attention_mask"],
            features["instruction_lengths"].tolist(),
            out["rationale_token_ids"][:, 0],
        )
        sequences.extend(
            (torch.cat([prompt[mask.bool()], rationale[rationale >= 0]]), span)
            for prompt, mask, span, rationale in rows
        )
    return sequences


@torch.no_grad()
def input_grams(lm, names: list[str], sequences: list[tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor]:
    """The input Gram matrix of each named linear layer of ``lm`` over ``sequences`` (:func:`encoded_sequences`)."""
    from tqdm.auto import tqdm

    hooks = InputGrams(lm, names)
    try:
        for sequence, _ in tqdm(sequences, desc="calibration inputs", unit="text"):
            lm(input_ids=sequence[None], use_cache=False)
    finally:
        hooks.remove()
    return hooks.grams


def calibration_grams(model, names: list[str], config: Path, count: int, seed: int) -> tuple[dict, int]:
    """The input Gram matrix of each named linear layer of ``model``'s LM over ``count`` training instances of
    ``config`` (prompts and rationales, :func:`encoded_sequences`), and the number of tokens behind them."""
    sequences = encoded_sequences(model, calibration_texts(config, count, seed))
    return input_grams(model[0].model, names, sequences), sum(len(s) for s, _ in sequences)


def _pooled_states(view, sequences: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
    """The hidden states ``encode`` pools (Eq. 3: the view's layer, positions after L_sys) of each sequence, run
    as one right-padded batch."""
    from grace_st.methods.grace import right_padded_states

    states = right_padded_states(view, [ids for ids, _ in sequences])
    return [states[row, span : len(ids)] for row, (ids, span) in enumerate(sequences)]


def _relative_error(student: list[torch.Tensor], teacher: list[torch.Tensor]) -> torch.Tensor:
    """Σ‖h_student − h_tuned‖² / Σ‖h_tuned‖² over every pooled position."""
    error = sum((s.float() - t).pow(2).sum() for s, t in zip(student, teacher))
    return error / sum(t.pow(2).sum() for t in teacher)


def distill(
    student,
    tuned,
    sequences: list[tuple[torch.Tensor, int]],
    *,
    steps: int,
    learning_rate: float,
    batch_size: int = 8,
    held_out: float = 0.1,
    seed: int = 0,
) -> dict:
    """Train ``student``'s LoRA factors (the rank-r cut) for ``steps`` steps toward the tuned model's own pooled
    states on ``sequences``, and keep the step whose error on a held-out tenth is lowest. Both are
    :class:`~grace_st.runtime.model_view.ModelView` s: the states are the view's layer's.

    The per-layer cut is fitted to each layer's outputs on its own, while ``encode`` depends on what the whole stack
    computes. This matches the states Eq. 3 pools, at every pooled position of prompt ⊕ rationale, with the tuned
    model's rationale as input: those states are the embedding's terms, and (through the tied LM head) the logits
    that choose the rationale's next token, so the rationale the adapter writes follows the tuned model's too.
    """
    # one generator for the split and the batches drawn: the run is the seed's alone
    generator = torch.Generator().manual_seed(seed)
    held, train = _held_out_split(sequences, held_out, generator)
    if not train:
        raise SystemExit(f"--distill-steps needs more than {len(sequences)} calibration sequences")
    train_batches, held_batches = _length_batches(train, batch_size), _length_batches(held, batch_size)
    with torch.no_grad():
        targets = {id(b): _pooled_states(tuned, b) for b in train_batches + held_batches}
    before, after, kept_step, curve = _train_keeping_best(
        student,
        train_batches,
        held_batches,
        targets,
        steps=steps,
        learning_rate=learning_rate,
        generator=generator,
    )
    return {
        "steps": steps,
        "learning_rate": learning_rate,
        "batch_size": batch_size,
        "sequences": len(train),
        "held_out_sequences": len(held),
        "kept_step": kept_step,
        "held_out_error_before": before,
        "held_out_error_after": after,
        "curve": curve,
    }


def _held_out_split(
    sequences: list[tuple[torch.Tensor, int]], held_out: float, generator: torch.Generator
) -> tuple[list, list]:
    """A random ``held_out`` share of ``sequences`` (at least one) and the rest, for training."""
    order = torch.randperm(len(sequences), generator=generator).tolist()
    cut = max(1, round(held_out * len(sequences)))
    return [sequences[i] for i in order[:cut]], [sequences[i] for i in order[cut:]]


def _length_batches(rows: list[tuple[torch.Tensor, int]], batch_size: int) -> list[list[tuple[torch.Tensor, int]]]:
    """``rows`` in batches of similar length, so short sequences do not pad to a long abstract."""
    rows = sorted(rows, key=lambda pair: len(pair[0]))
    return [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]


def _held_out_error(student, held_batches: list, targets: dict) -> float:
    """The student's relative error over every held-out batch (:func:`_relative_error`), without gradient."""
    with torch.no_grad():
        states = [state for b in held_batches for state in _pooled_states(student, b)]
        return float(_relative_error(states, [t for b in held_batches for t in targets[id(b)]]))


def _train_keeping_best(
    student,
    train_batches: list,
    held_batches: list,
    targets: dict,
    *,
    steps: int,
    learning_rate: float,
    generator: torch.Generator,
) -> tuple[float, float, int, list[dict]]:
    """AdamW on the student's LoRA factors (cosine decay to 0), a random training batch a step, the held-out error
    checked every eighth of the run; the factors are left at the checked step with the lowest error (step 0, the
    cut itself, included). Returns the error before and after, that step, and the checks' curve."""
    from tqdm.auto import tqdm

    factors = [p for name, p in student.model.named_parameters() if "lora_" in name]
    optimizer = torch.optim.AdamW(factors, lr=learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / steps)))
    before = _held_out_error(student, held_batches, targets)
    best = (before, 0, [p.detach().clone() for p in factors])
    curve = [{"step": 0, "held_out_error": before}]
    check_every = max(1, steps // 8)
    bar = tqdm(range(1, steps + 1), desc="distilling the cut", unit="step")
    for step in bar:
        batch = train_batches[int(torch.randint(len(train_batches), (1,), generator=generator))]
        with torch.enable_grad():  # lowrank_adapter runs under no_grad
            loss = _relative_error(_pooled_states(student, batch), targets[id(batch)])
            loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.4g}")
        if step % check_every == 0 or step == steps:
            error = _held_out_error(student, held_batches, targets)
            curve.append({"step": step, "train_batch_error": float(loss), "held_out_error": error})
            if error < best[0]:
                best = (error, step, [p.detach().clone() for p in factors])
    with torch.no_grad():
        for p, kept in zip(factors, best[2]):
            p.copy_(kept)
    return before, best[0], best[1], curve


@torch.no_grad()
def lowrank_adapter(
    tuned: Path,
    out: Path,
    rank: int,
    *,
    base: Path | None = None,
    config: Path | None = None,
    calibration: int = 256,
    seed: int = 0,
    distill_steps: int = 0,
    distill_learning_rate: float = 3e-5,
) -> dict:
    """Write ``tuned``'s delta from ``base`` as a rank-``rank`` LoRA adapter model into ``out``, refined by
    ``distill_steps`` steps of :func:`distill` on the calibration sequences; return the summary."""
    from grace_st import default_model_path

    _check_arguments(rank, out, config, calibration, distill_steps, distill_learning_rate)
    base = base or Path(default_model_path(trained=False))
    tuned_model, model, tuned_weights, base_weights = _load_models(tuned, base)
    if calibration and tuned_model[0].method == "grc":  # its calibration sequences would leave out the latents
        raise SystemExit(f"{tuned}: a GRC model is cut by the plain SVD, without the latents: give --calibration 0")
    tuned_lm, lm = tuned_model[0].model, model[0].model
    names = _target_layers(lm, base)

    sequences = encoded_sequences(tuned_model, calibration_texts(config, calibration, seed)) if calibration else []
    grams = input_grams(tuned_lm, names, sequences) if calibration else {}

    peft_model = _lora_model(lm, rank)
    kept = _write_cuts(peft_model, names, tuned_weights, base_weights, rank, grams)

    distillation = None
    if distill_steps:
        tuned_view = tuned_model[0].engine.view
        distillation = distill(
            dataclasses.replace(tuned_view, model=lm),
            tuned_view,
            sequences,
            steps=distill_steps,
            learning_rate=distill_learning_rate,
            seed=seed,
        )

    outside, inside = _delta_energy(tuned_weights, base_weights, names)
    _save_adapter_model(model, tuned_model, peft_model, tuned, out)
    summary = {
        "tuned": str(tuned),
        **_trained_from(tuned),
        "base": str(base),
        "rank": rank,
        "calibration": _calibration_summary(calibration, sequences, config, seed),
        # share of the delta's energy (‖ΔW‖²) not in the decoder's linear layers: embeddings and norms, not carried
        "delta_share_not_carried": outside / (outside + inside),
        "kept_by_layer": _kept_by_layer(kept),
        # kept_by_layer describes the cut; the saved factors are the cut refined by this
        "distillation": distillation,
    }
    (out / LOWRANK_FROM).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary


def _check_arguments(
    rank: int, out: Path, config: Path | None, calibration: int, distill_steps: int, distill_learning_rate: float
) -> None:
    """Refuse arguments :func:`lowrank_adapter` cannot use before any model is loaded."""
    if rank < 1:
        raise SystemExit(f"--rank {rank}: give a rank of at least 1")
    if out.exists():
        raise SystemExit(f"{out} exists: give a new directory")
    if calibration and config is None:
        raise SystemExit("--calibration needs --config: the grace-train config whose training data the texts come from")
    if distill_steps < 0 or distill_learning_rate <= 0:
        raise SystemExit(
            f"--distill-steps {distill_steps} --distill-learning-rate {distill_learning_rate}: give steps >= 0 and a "
            "positive rate"
        )
    if distill_steps and not calibration:
        raise SystemExit("--distill-steps needs --calibration > 0: it trains on the calibration sequences")


def _load_models(tuned: Path, base: Path) -> tuple:
    """The tuned and the base model on the CPU and their LMs' weights; refused unless the two share one
    architecture."""
    from grace_st.files.loading import load
    from grace_training.tools.interpolate_weights import check_one_architecture

    tuned_model, model = load(str(tuned), device="cpu"), load(str(base), device="cpu")
    tuned_weights, base_weights = tuned_model[0].model.state_dict(), model[0].model.state_dict()
    check_one_architecture(tuned_weights, base_weights, tuned, base)
    return tuned_model, model, tuned_weights, base_weights


def _target_layers(lm: torch.nn.Module, base: Path) -> list[str]:
    """The names of ``lm``'s linear layers of the kinds in :data:`TARGET_MODULES`: the layers the adapter carries."""
    names = [
        name
        for name, module in lm.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGET_MODULES
    ]
    if not names:
        raise SystemExit(f"{base}: no linear layer named {', '.join(TARGET_MODULES)}")
    return names


def _lora_model(lm: torch.nn.Module, rank: int):
    """``lm`` with rank-``rank`` PEFT LoRA layers on every target module; ``lora_alpha = rank``, so the scaling is 1
    and ``lora_B @ lora_A`` is the delta itself."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=rank,
        lora_alpha=rank,
        lora_dropout=0.0,
        target_modules=list(TARGET_MODULES),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(lm, lora)


def _write_cuts(peft_model, names: list[str], tuned_weights: dict, base_weights: dict, rank: int, grams: dict) -> dict:
    """Each named layer's delta cut to rank ``rank`` (:func:`lowrank_factors`) into its LoRA factors; returns, by kind
    of layer, the squared error and the squared delta in the weights and in the outputs on the calibration inputs."""
    layers = dict(peft_model.base_model.model.named_modules())
    kept: dict[str, list[float]] = {}
    for name in names:
        delta = tuned_weights[f"{name}.weight"] - base_weights[f"{name}.weight"]
        a, b = lowrank_factors(delta, rank, grams.get(name))
        layers[name].lora_A["default"].weight.copy_(a)
        layers[name].lora_B["default"].weight.copy_(b)
        gram = grams.get(name)
        error = delta - b @ a
        # the share of the delta's energy kept: in the weights, and in the layer's outputs on the calibration inputs
        kind = kept.setdefault(name.rsplit(".", 1)[-1], [0.0, 0.0, 0.0, 0.0])
        kind[0] += float(error.pow(2).sum())
        kind[1] += float(delta.pow(2).sum())
        if gram is not None:
            kind[2] += float(((error.double() @ gram) * error.double()).sum())
            kind[3] += float(((delta.double() @ gram) * delta.double()).sum())
    return kept


def _delta_energy(tuned_weights: dict, base_weights: dict, names: list[str]) -> tuple[float, float]:
    """‖ΔW‖² outside the named layers (embeddings and norms, which the adapter does not carry) and inside them."""
    from grace_training.tools.interpolate_weights import distinct_weights

    carried = {f"{name}.weight" for name in names}
    untied = [k for k in distinct_weights(tuned_weights) if k not in carried]
    outside = sum(float((tuned_weights[k] - base_weights[k]).pow(2).sum()) for k in untied)
    inside = sum(float((tuned_weights[k] - base_weights[k]).pow(2).sum()) for k in carried)
    return outside, inside


def _save_adapter_model(model, tuned_model, peft_model, tuned: Path, out: Path) -> None:
    """The base model with the adapter and the tuned model's encoder settings (and a GRC model's latent tokens),
    saved into ``out`` with the tuned model's training state."""
    encoder, tuned_encoder = model[0], tuned_model[0]
    for key in encoder.config_keys:
        if key != "weights_revision":
            setattr(encoder, key, getattr(tuned_encoder, key))
    encoder.model = peft_model
    encoder.latent_tokens = tuned_encoder.latent_tokens  # GRC's, trained in full: carried as they are
    model.save(str(out))
    _copy_training_state(tuned, out)


def _calibration_summary(calibration: int, sequences: list, config: Path | None, seed: int) -> dict | None:
    """What the calibration ran on, for the summary; None for the plain SVD."""
    if not calibration:
        return None
    return {
        "instances": calibration,
        "tokens": sum(len(ids) for ids, _ in sequences),
        "config": str(config),
        "seed": seed,
    }


def _kept_by_layer(kept: dict[str, list[float]]) -> dict:
    """By kind of layer, the share of the delta's energy the cut kept: in the weights, and in the outputs on the
    calibration inputs when there were any."""
    return {
        kind: {
            "weights": 1 - e / d,
            **({"outputs_on_calibration": 1 - ge / gd} if gd else {}),
        }
        for kind, (e, d, ge, gd) in kept.items()
    }


def _trained_from(tuned: Path) -> dict:
    """The tuned model's own start and step when it is a grace-train checkpoint (a stage on a full fine-tuning)."""
    state = tuned / "trainer_state" / "state.json"
    if not state.is_file():
        return {}
    saved = json.loads(state.read_text(encoding="utf-8"))
    return {"tuned_from": saved["config"].get("model_name_or_path"), "tuned_steps": saved["step"]}


def _copy_training_state(tuned: Path, out: Path) -> None:
    """The last stage's ``trainer_state/state.json`` (its config and step, for ``export_adapter``'s summary), not its
    optimizer state, which belongs to the full-rank run."""
    state = tuned / "trainer_state" / "state.json"
    if state.is_file():
        (out / "trainer_state").mkdir(exist_ok=True)
        shutil.copyfile(state, out / "trainer_state" / "state.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "tuned", type=Path, help="a saved GRACE, GIRCSE or GRC model: full weights, or an adapter on a full-weight model"
    )
    parser.add_argument("--rank", type=int, required=True, help="the LoRA rank of every layer")
    parser.add_argument("--out", type=Path, required=True, help="a new directory")
    parser.add_argument("--base", type=Path, help="the adapter's base (default: the untrained embedded base)")
    parser.add_argument("--config", type=Path, help="a grace-train config: its training data are the calibration texts")
    parser.add_argument(
        "--calibration",
        type=int,
        default=256,
        help="training instances whose prompts and rationales calibrate the approximation (0: the plain SVD)",
    )
    parser.add_argument("--seed", type=int, default=0, help="which instances")
    parser.add_argument(
        "--distill-steps",
        type=int,
        default=0,
        help="steps that train the cut toward the tuned model's pooled states on the calibration sequences (0: none)",
    )
    parser.add_argument("--distill-learning-rate", type=float, default=3e-5, help="AdamW's peak rate, cosine decay")
    args = parser.parse_args(argv)
    summary = lowrank_adapter(
        args.tuned,
        args.out,
        args.rank,
        base=args.base,
        config=args.config,
        calibration=args.calibration,
        seed=args.seed,
        distill_steps=args.distill_steps,
        distill_learning_rate=args.distill_learning_rate,
    )
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
