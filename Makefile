# Set-up is idempotent: each target re-runs only what is missing.
PYTHON ?= python3
VENV := .venv
VENV_ST5 := .venv-st5
VENV_GPU := .venv-gpu
PY := $(VENV)/bin/python
PY_ST5 := $(VENV_ST5)/bin/python
# torch first and pinned: 2.13.0 is the local CPU wheel; any other spec pulls CUDA wheels.
TORCH := torch==2.13.0
ST5 := sentence-transformers==5.2.3

.PHONY: demo test test-st6 test-st5 venv venv-st5 model bench train-default train-scale train-gircse gpu-check clean

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
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev,mteb,langchain,llamaindex,bench,training]"
	touch $@

venv-st5: $(VENV_ST5)/.installed
$(VENV_ST5)/.installed: pyproject.toml Makefile
	test -x $(PY_ST5) || $(PYTHON) -m venv $(VENV_ST5)
	$(PY_ST5) -m pip install -q $(TORCH)
	$(PY_ST5) -m pip install -q -e ".[dev,training]" "$(ST5)"
	touch $@

# Builds the embedded default model under $GRACE_ST_HOME (default ~/.cache/grace_st) once.
model: $(VENV)/.installed
	$(PY) -c "import grace_st; print(grace_st.default_model_path())"

bench: $(VENV)/.installed model
	$(PY) benchmarks/encode_throughput.py
	$(PY) benchmarks/decode_ablation.py

# Reproduces the shipped adapter (grace_st/default_adapter) in two stages, each in chunks of at most 55 minutes resumed
# from the last checkpoint (run it again after an interruption): step 400 of the [scale] recipe (docs/scale.md section 11,
# 1.75 CPU hours of steps), then 68 hybrid steps from that adapter (section 12: init_adapter, seed 43, 10 warm-up steps;
# 0.75 CPU hours on session 9's slower machine, about 0.4 on session 8's). About 2.5-3 hours on a 2-core CPU; then it
# exports the result into the package, to decode with repetition_penalty 1.3 (chosen on dev data, docs/scale.md section 21).
DEFAULT_STEP := 400
DEFAULT_RUN := runs/train_default
CONTINUED_STEP := 68
CONTINUED_RUN := runs/train_default_continued
train-default: $(VENV)/.installed model
	for chunk in 1 2 3 4 5 6; do \
		[ -d $(DEFAULT_RUN)/checkpoint-$$(printf %08d $(DEFAULT_STEP)) ] && break; \
		$(VENV)/bin/grace-train --config grace_training/configs/scale_grace.yaml output_dir=$(DEFAULT_RUN) \
			max_steps=$(DEFAULT_STEP) --resume --max-minutes 55 || exit 1; \
	done
	for chunk in 1 2 3; do \
		[ -d $(CONTINUED_RUN)/checkpoint-$$(printf %08d $(CONTINUED_STEP)) ] && break; \
		$(VENV)/bin/grace-train --config grace_training/configs/scale_grace.yaml output_dir=$(CONTINUED_RUN) \
			init_adapter=$(DEFAULT_RUN)/checkpoint-$$(printf %08d $(DEFAULT_STEP)) warm_start_steps=0 seed=43 \
			warmup_steps=10 max_steps=$(CONTINUED_STEP) --resume --max-minutes 55 || exit 1; \
	done
	$(PY) -m grace_training.export_adapter $(CONTINUED_RUN)/checkpoint-$$(printf %08d $(CONTINUED_STEP)) --repetition-penalty 1.3

# The [scale] run (docs/scale.md): one chunk of at most 55 minutes a call, resumed from its latest
# checkpoint; call it again until the run reaches max_steps (warm start, then the hybrid, in one run).
train-scale: $(VENV)/.installed model
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/grace-train --config grace_training/configs/scale_grace.yaml \
		output_dir=runs/scale_grace --resume --max-minutes 55

# GIRCSE (docs/gircse_study.md): soft tokens trained by Iterative Contrastive Refinement on the [scale] data, one chunk of
# at most 55 minutes a call, resumed from its latest checkpoint. Export a checkpoint into the package with
# `python -m grace_training.export_adapter runs/gircse/checkpoint-N` (it goes to grace_st/gircse_adapter).
train-gircse: $(VENV)/.installed model
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/grace-train --config grace_training/configs/gircse_smollm2.yaml \
		--resume --max-minutes 55

# On a machine with a CUDA GPU: HF vs vLLM encode, GRPO steps with vLLM rollouts in bf16, one JSON
# report (benchmarks/results/gpu_check.json). vLLM brings its own CUDA torch, hence a venv of its
# own. Without a GPU the preflight says so in one line and nothing is installed.
gpu-check:
	@$(PYTHON) benchmarks/gpu_check.py --preflight
	test -x $(VENV_GPU)/bin/python || $(PYTHON) -m venv $(VENV_GPU)
	$(VENV_GPU)/bin/python -m pip install -q -e ".[vllm,training]"
	$(VENV_GPU)/bin/python benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) $(VENV_ST5) $(VENV_GPU) *.egg-info
