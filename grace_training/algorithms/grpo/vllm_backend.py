"""vLLM rollout backend (GPU): an engine in the trainer's process, weights synced after each update.

The engine generates token ids only. Embeddings (Eq. 3) come from one no-gradient forward pass
of the trainer's own policy over ``P(x) ⊕ r`` (:func:`grace_training.algorithms.grpo.rollout.embed_rollouts`, which is
``grace_st.runtime.second_pass.pooled_embeddings``, the pass the encoder's own vLLM path pools with),
so the pooled states are the trainer's, in the trainer's precision, through the same pooling
code ``encode`` uses.

Generation goes through ``grace_st.runtime.vllm_backend.VLLMRationaleGenerator``, the generator the
encoder's own vLLM path uses: the same stopping rules, the EOS id that ended each rationale
(part of the action scored in Eq. 11), and a temperature a row, so one call serves a step's
queries, negatives and positives.

Weight sync: after each optimiser step the trainer calls :meth:`VLLMRolloutEngine.load_weights`
with the policy's ``(name, tensor)`` pairs. The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the weights are handed to the engine's model's
``load_weights`` directly, then the prefix cache is reset (its KV entries belong to the old
weights). ``gpu_memory_utilization`` sets the engine's share of the GPU (paper: 0.5).

vLLM is optional (``pip install grace-st[vllm]``): this module imports it only when an engine
is built, and the trainer refuses ``rollout_backend="vllm"`` with a clear message without it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from torch import Tensor

from grace_st.runtime.batch import Rationales
from grace_training.algorithms.grpo.rollout import Generated, RolloutRequest, embed_rollouts


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


class VLLMRolloutEngine:
    """Rollouts with a colocated vLLM ``LLM``; the contract of ``rollout.hf_generate`` (a
    :class:`~grace_training.algorithms.grpo.rollout.RolloutRequest` in, :class:`~grace_training.algorithms.grpo.rollout.Generated` out).

    Args:
        encoder: the trainer's GenerativeEncoder (tokenizer, EOS ids, the policy for embeddings).
        model_path: a directory vLLM can load (the run's starting model directory).
        gpu_memory_utilization: the engine's share of GPU memory (weights + KV cache).
        llm: an already built engine (tests pass a stand-in).
    """

    def __init__(
        self,
        encoder,
        model_path: str | None = None,
        *,
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        dtype: str = "auto",
        seed: int = 0,
        enable_sleep_mode: bool = False,
        embed_batch_size: int = 64,
        llm=None,
    ) -> None:
        from grace_st.runtime.vllm_backend import VLLMRationaleGenerator

        self.encoder = encoder
        self.embed_batch_size = embed_batch_size
        if llm is None:
            if not vllm_available():
                raise ImportError("rollout_backend='vllm' needs vLLM: pip install 'grace-st[vllm]' (GPU only)")
            # In-process engine core: the trainer can reach the engine's model to load weights.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.generator = VLLMRationaleGenerator(
            model_path,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            llm=llm,
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len,
            enable_prefix_caching=True,
            enable_sleep_mode=enable_sleep_mode,
        )
        self.llm = self.generator.llm

    # -- generation -----------------------------------------------------------------------------

    def generate(self, request: RolloutRequest) -> Generated:
        """Rationales (one call for every row, a temperature each), then Eq. 3 embeddings from
        one no-gradient pass of the trainer's policy. A budget of 0 (documents embedded from their
        prompt alone) generates nothing: the pass pools the prompts."""
        if request.max_new_tokens == 0:
            rows = len(request.prompt_ids)
            rationales = Rationales([[] for _ in range(rows)], [-1] * rows, [False] * rows)
        else:
            rationales = self._generate(request)
        embeddings = embed_rollouts(
            self.encoder,
            request.prompt_ids,
            request.instruction_lengths,
            rationales.rationale_ids,
            self.embed_batch_size,
        )
        return Generated.of(rationales, embeddings)

    def _generate(self, request: RolloutRequest) -> Rationales:
        return self.generator.generate(
            request.prompt_ids,
            max_new_tokens=request.max_new_tokens,
            eos_token_ids=self.encoder.eos_token_ids,
            do_sample=True,  # a row at temperature 0 is greedy
            temperature=request.temperatures,
            top_p=request.top_p,
            seeds=request.seeds,
        )

    # -- weight sync ----------------------------------------------------------------------------

    def _engine_model(self):
        """The engine's ``nn.Module`` (in-process engine: V0, or V1 without multiprocessing)."""
        executor = self.llm.llm_engine.model_executor
        worker = executor.driver_worker
        worker = getattr(worker, "worker", worker)  # V1 wraps the worker
        return worker.model_runner.model

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy the trainer's weights into the live engine, then drop KV entries of the old ones."""
        weights = list(named_tensors)
        try:
            model = self._engine_model()
        except AttributeError:
            # Engine in a separate process: run the load inside each worker instead.
            self.llm.collective_rpc(_load_on_worker, args=(weights,))
        else:
            model.load_weights(weights)
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()

    def sync_from(self, policy) -> None:
        """Load a (possibly sharded, e.g. FSDP2) policy's full weights into the engine."""
        state = policy.state_dict()
        full = {}
        for name, tensor in state.items():
            tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            full[name] = tensor.detach()
        self.load_weights(full.items())


def build_rollout_engine(encoder, st_model, config, accelerator) -> VLLMRolloutEngine:
    """The trainer's vLLM engine, loaded from the run's starting model directory (saved to
    ``<output_dir>/initial-model`` by the main process when the model came from elsewhere)."""
    from grace_training.run.checkpoint import save_model_dir

    path = config.model_name_or_path
    if path is None or not Path(path).exists():
        path = str(Path(config.output_dir) / "initial-model")
        if accelerator.is_main_process:
            save_model_dir(st_model, Path(path))
        accelerator.wait_for_everyone()
    return VLLMRolloutEngine(
        encoder,
        path,
        gpu_memory_utilization=config.vllm_gpu_memory_utilization,
        tensor_parallel_size=config.vllm_tensor_parallel_size,
        max_model_len=config.max_input_tokens + config.longest_response + 1,
        dtype="bfloat16" if config.bf16 else "auto",
        seed=config.seed,
        enable_sleep_mode=config.vllm_enable_sleep_mode,
    )


def _load_on_worker(worker, weights):
    worker.model_runner.model.load_weights(weights)
