"""vLLM rollout backend (GPU): an engine in the trainer's process, weights synced after each update.

The engine generates token ids only. Embeddings (Eq. 3) come from one no-gradient forward pass
of the trainer's own policy over ``P(x) ⊕ r`` (:func:`grace_training.rollout.embed_rollouts`, which is
``grace_st.generation.pooled_embeddings``, the pass the encoder's own vLLM path pools with),
so the pooled states are the trainer's, in the trainer's precision, through the same pooling
code ``encode`` uses.

The engine is built by ``grace_st.vllm_backend.VLLMRationaleGenerator`` (the encoder's own vLLM
backend); generation calls the engine directly with the same stopping rules, because the trainer
also needs *which* EOS token ended each rationale (it is part of the action scored in Eq. 11).

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

import torch
from torch import Tensor

from .rollout import embed_rollouts


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def _sampling_params_class():
    """vLLM's SamplingParams; a seam for tests that stand in for vLLM."""
    from vllm import SamplingParams

    return SamplingParams


class VLLMRolloutEngine:
    """Rollouts with a colocated vLLM ``LLM``; same call contract as ``rollout.hf_generate``.

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
        self.encoder = encoder
        self.embed_batch_size = embed_batch_size
        self.enable_sleep_mode = enable_sleep_mode
        if llm is None:
            if not vllm_available():
                raise ImportError("rollout_backend='vllm' needs vLLM: pip install 'grace-st[vllm]' (GPU only)")
            # In-process engine core: the trainer can reach the engine's model to load weights.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            from grace_st.vllm_backend import VLLMRationaleGenerator

            llm = VLLMRationaleGenerator(
                model_path,
                dtype=dtype,
                gpu_memory_utilization=gpu_memory_utilization,
                seed=seed,
                tensor_parallel_size=tensor_parallel_size,
                max_model_len=max_model_len,
                enable_prefix_caching=True,
                enable_sleep_mode=enable_sleep_mode,
            ).llm
        self.llm = llm

    # -- generation -----------------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: list[list[int]],
        instruction_lengths: list[int],
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seeds: list[int],
    ) -> tuple[list[list[int]], list[int], Tensor, Tensor]:
        SamplingParams = _sampling_params_class()
        eos = sorted(set(self.encoder.eos_token_ids))
        params = [
            SamplingParams(
                n=1,
                temperature=temperature,  # 0 is greedy in vLLM as in the HF backend
                top_p=top_p if temperature > 0 else 1.0,
                max_tokens=max_new_tokens,
                # exactly the encoder's EOS set, as grace_st.vllm_backend and the HF backend stop
                stop_token_ids=eos,
                ignore_eos=True,
                seed=int(seed) % (2**63) if temperature > 0 else None,
                detokenize=False,
            )
            for seed in seeds
        ]
        prompts = [{"prompt_token_ids": [int(t) for t in p]} for p in prompt_ids]  # vllm.inputs.TokensPrompt
        outputs = self.llm.generate(prompts, sampling_params=params, use_tqdm=False)
        rationales, stops, truncated = [], [], []
        eos_set = set(eos)
        for output in outputs:
            completion = output.outputs[0]
            ids = list(completion.token_ids)
            stop = -1
            # vLLM keeps the stop token in token_ids; the rationale is what precedes it.
            cut = next((i for i, t in enumerate(ids) if t in eos_set), None)
            if cut is not None:
                stop, ids = ids[cut], ids[:cut]
            rationales.append(ids)
            stops.append(stop)
            truncated.append(stop < 0 and completion.finish_reason == "length")
        embeddings = embed_rollouts(self.encoder, prompt_ids, instruction_lengths, rationales, self.embed_batch_size)
        return rationales, stops, embeddings, torch.tensor(truncated, dtype=torch.bool)

    __call__ = generate

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

    def sleep(self) -> None:
        if self.enable_sleep_mode:
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        if self.enable_sleep_mode:
            self.llm.wake_up()


def _load_on_worker(worker, weights):
    worker.model_runner.model.load_weights(weights)
