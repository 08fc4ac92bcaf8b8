# Set-up is idempotent: each target re-runs only what is missing.
PYTHON ?= python3
VENV := .venv
VENV_ST5 := .venv-st5
VENV_GPU := .venv-gpu
PY := $(VENV)/bin/python
PY_ST5 := $(VENV_ST5)/bin/python
# torch first and pinned: 2.13.0 is the local CPU wheel; any other spec pulls CUDA wheels.
# pip -qq: errors only (a dependency's missing extra or a configured index location is not the user's problem).
TORCH := torch==2.13.0
ST5 := sentence-transformers==5.2.3

.PHONY: demo test test-st6 test-st5 venv venv-st5 model bench train-default train-scale train-gircse train-grc gpu-check clean

demo: $(VENV)/.installed model
	$(VENV)/bin/grace-st encode \
		"A man is playing a guitar on stage." \
		"Someone performs a song with an acoustic guitar." \
		"The central bank raised interest rates again." \
		"Stock markets fell after the rate decision."

test: test-st6 test-st5

test-st6: $(VENV)/.installed model
	$(PY) -m pytest -q tests

# The same unit tests against sentence-transformers 5.x (the real-model tests run once, above).
test-st5: $(VENV_ST5)/.installed
	$(PY_ST5) -m pytest -q -m "not slow" tests -p no:cacheprovider

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -qq $(TORCH)
	$(PY) -m pip install -qq -e ".[dev,server,mteb,langchain,llamaindex,bench,training,distributed]"
	touch $@

venv-st5: $(VENV_ST5)/.installed
$(VENV_ST5)/.installed: pyproject.toml Makefile
	test -x $(PY_ST5) || $(PYTHON) -m venv $(VENV_ST5)
	$(PY_ST5) -m pip install -qq $(TORCH)
	$(PY_ST5) -m pip install -qq -e ".[dev,server,training]" "$(ST5)"
	touch $@

# Builds the embedded default model under $GRACE_ST_HOME (default ~/.cache/grace_st) once.
model: $(VENV)/.installed
	$(PY) -c "import grace_st; print(grace_st.default_model_path())"

bench: $(VENV)/.installed model
	$(PY) benchmarks/encode_throughput.py
	$(PY) benchmarks/decode_ablation.py

# Reproduces the shipped adapter (grace_st/adapters/default, decisions/D028-D030) in three steps; the first two run
# in chunks of at most 55 minutes resumed from the last checkpoint (run it again after an interruption):
# 1. the yardstick: InfoNCE with full fine-tuning on the scale recipe's data, stopped at step 455 of its 1000-step run
#    (decisions/D028: 1.52 CPU hours, 62 minutes on a 2-core AVX-512 CPU);
# 2. the shipped last stage from it: 100 steps of the hybrid (LoRA r 8, text_kl_coef 1, seed 46; 0.68 CPU hours);
# 3. the whole delta from the base as a rank-32 LoRA adapter fitted to the layers' inputs on 256 training instances,
#    then 200 steps of distillation toward the full model's pooled states on them (grace_training.tools.lowrank_adapter,
#    16 minutes; decisions/D030), exported into the package in bfloat16, decoding with repetition_penalty 1.3 (chosen on
#    dev data, decisions/D024). 85 minutes on a 2-core AVX-512 CPU (48 + 21 + 16).
YARDSTICK_RUN := runs/train_default_yardstick
YARDSTICK_STEP := 455
STAGE_RUN := runs/train_default_stage
STAGE_STEP := 100
LOWRANK_RANK := 32
LOWRANK_DIR := runs/train_default_lowrank$(LOWRANK_RANK)
train-default: $(VENV)/.installed model
	for chunk in 1 2 3 4; do \
		[ -f $(YARDSTICK_RUN)/trainer/checkpoint-$(YARDSTICK_STEP)/trainer_state.json ] && break; \
		resume=$$(ls -d $(YARDSTICK_RUN)/trainer/checkpoint-* >/dev/null 2>&1 && echo --resume); \
		$(VENV)/bin/grace-train --config grace_training/configs/scale_grace.yaml --algorithm infonce \
			output_dir=$(YARDSTICK_RUN) finetune=full infonce_learning_rate=1e-5 save_steps=$(YARDSTICK_STEP) \
			save_total_limit=2 --stop-at-step $(YARDSTICK_STEP) $$resume --max-minutes 55 || exit 1; \
	done
	for chunk in 1 2 3; do \
		[ -d $(STAGE_RUN)/checkpoint-$$(printf %08d $(STAGE_STEP)) ] && break; \
		$(VENV)/bin/grace-train --config grace_training/configs/scale_grace.yaml \
			model_name_or_path=$(YARDSTICK_RUN)/final output_dir=$(STAGE_RUN) warm_start_steps=0 seed=46 'eval_data=[]' \
			save_steps=25 --stop-at-step $(STAGE_STEP) --resume --max-minutes 55 || exit 1; \
	done
	rm -rf $(LOWRANK_DIR)
	$(PY) -m grace_training.tools.lowrank_adapter $(STAGE_RUN)/checkpoint-$$(printf %08d $(STAGE_STEP)) \
		--rank $(LOWRANK_RANK) --config grace_training/configs/scale_grace.yaml --out $(LOWRANK_DIR) \
		--distill-steps 200 --distill-learning-rate 5e-5
	$(PY) -m grace_training.tools.export_adapter $(LOWRANK_DIR) --into-package --bfloat16 --repetition-penalty 1.3

# The scale-recipe run (decisions/D009-D013): one chunk of at most 55 minutes a call, resumed from its latest
# checkpoint; call it again until the run reaches max_steps (warm start, then the hybrid, in one run).
train-scale: $(VENV)/.installed model
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/grace-train --config grace_training/configs/scale_grace.yaml \
		output_dir=runs/scale_grace --resume --max-minutes 55

# GIRCSE (docs/gircse.md; decisions/D017, D033): soft tokens trained by Iterative Contrastive Refinement on the scale recipe's data, one chunk of
# at most 55 minutes a call, resumed from its latest checkpoint. Export a checkpoint into the package with
# `python -m grace_training.tools.export_adapter runs/gircse/checkpoint-N --into-package` (it goes to grace_st/adapters/gircse).
train-gircse: $(VENV)/.installed model
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/grace-train --config grace_training/configs/gircse_smollm2.yaml \
		--resume --max-minutes 55

# GRC (docs/grc.md, decisions/D036, D039): meta latent tokens trained by Eq. 5 on the same data, fully fine-tuned
# for 125 steps (0.9 CPU hours on one thread) in chunks of at most 55 minutes, each resumed from the latest
# checkpoint; then the delta from the base cut to a rank-32 LoRA adapter (the plain SVD, latents carried whole) and
# exported into grace_st/adapters/grc in bfloat16.
GRC_RUN := runs/grc
GRC_STEP := 125
GRC_LOWRANK_DIR := runs/grc_lowrank32
train-grc: $(VENV)/.installed model
	for chunk in 1 2 3 4; do \
		[ -d $(GRC_RUN)/checkpoint-$$(printf %08d $(GRC_STEP)) ] && break; \
		OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/grace-train --config grace_training/configs/grc_smollm2.yaml \
			output_dir=$(GRC_RUN) max_steps=$(GRC_STEP) --resume --max-minutes 55 || exit 1; \
	done
	rm -rf $(GRC_LOWRANK_DIR)
	$(PY) -m grace_training.tools.lowrank_adapter $(GRC_RUN)/checkpoint-$$(printf %08d $(GRC_STEP)) --rank 32 \
		--calibration 0 --out $(GRC_LOWRANK_DIR)
	$(PY) -m grace_training.tools.export_adapter $(GRC_LOWRANK_DIR) --into-package --bfloat16

# On a machine with a CUDA GPU: HF vs vLLM encode, GRPO steps with vLLM rollouts in bf16, one JSON
# report (benchmarks/results/gpu_check.json). vLLM brings its own CUDA torch, hence a venv of its
# own. Without a GPU the preflight says so in one line and nothing is installed.
gpu-check:
	@$(PYTHON) benchmarks/gpu_check.py --preflight
	test -x $(VENV_GPU)/bin/python || $(PYTHON) -m venv $(VENV_GPU)
	$(VENV_GPU)/bin/python -m pip install -qq -e ".[vllm,training]"
	$(VENV_GPU)/bin/python benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) $(VENV_ST5) $(VENV_GPU) *.egg-info
