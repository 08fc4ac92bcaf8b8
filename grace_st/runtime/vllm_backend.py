"""The encoder's contract on vLLM (optional extra: ``pip install "grace-st[vllm]"``, CUDA only).

vLLM writes the rationales (Eq. 1) and an HF forward pass over ``P(x) ⊕ r`` gives the hidden
states that are pooled (Eqs. 2–3), which is how the reference implementation splits the work.
Under greedy decoding the rationales are the HF backend's (:func:`grace_st.runtime.generation.generate_rollouts`)
and so are the embeddings, up to floating point.

- :class:`VLLMRationaleGenerator`: token-id prompts in; :class:`grace_st.runtime.generation.Rationales`
  out, the contract the HF rollout meets too: rationale token ids (EOS and anything after it
  excluded), the EOS id that ended each (−1 where none did) and truncation flags (Eq. 28). The
  encoder's vLLM path and the trainer's vLLM rollouts
  (``grace_training.algorithms.grpo.vllm_backend``) both generate through it.
- :func:`pooled_embeddings` (from :mod:`grace_st.runtime.second_pass`): the HF pass and Eq. 3 pooling
  over given rationales.

``import grace_st.runtime.vllm_backend`` never needs vLLM; only constructing the generator does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grace_st.runtime.batch import Rationales, per_row
from grace_st.runtime.second_pass import pooled_embeddings

__all__ = ["INSTALL_HINT", "VLLMRationaleGenerator", "pooled_embeddings"]

INSTALL_HINT = 'pip install "grace-st[vllm]"'


def _sampling_params_class():
    """vLLM's SamplingParams; a seam for tests that stand in for vLLM."""
    from vllm import SamplingParams

    return SamplingParams


class VLLMRationaleGenerator:
    """Generates rationales with vLLM, with the stopping and truncation rules of
    :func:`grace_st.runtime.generation.generate_rollouts`.

    Args:
        model_name_or_path: a GRACE model directory (``SentenceTransformer.save`` of
            :func:`grace_st.from_causal_lm`: a causal-LM directory at its root) or any causal LM.
        dtype: weights and activations, as vLLM names them. ``"auto"`` is vLLM's choice, which
            turns a float32 checkpoint into float16; pass the HF model's dtype (e.g.
            ``"float32"``) where rationales must equal the HF backend's.
        gpu_memory_utilization: share of the GPU's memory vLLM may take (weights + KV cache).
            Leave room for the HF model that pools.
        seed: vLLM's engine seed (used by sampled rows that get no per-row seed).
        llm: an engine already built (the trainer's, or a test's stand-in); then nothing else
            is passed to vLLM.
        llm_kwargs: passed to ``vllm.LLM`` (e.g. ``max_model_len``, ``enforce_eager``).
    """

    def __init__(
        self,
        model_name_or_path: str,
        *,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.5,
        seed: int = 0,
        llm: Any = None,
        **llm_kwargs: Any,
    ) -> None:
        self.model_name_or_path = model_name_or_path
        if llm is not None:
            self.llm = llm
            return
        try:
            import vllm
        except ImportError as error:
            raise ImportError(
                f"VLLMRationaleGenerator needs vLLM, which is not installed (it needs a CUDA GPU): {INSTALL_HINT}"
            ) from error
        self.llm = vllm.LLM(
            model=model_name_or_path,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            **llm_kwargs,
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        eos_token_ids: Sequence[int],
        do_sample: bool = False,
        temperature: float | Sequence[float] = 1.0,
        top_p: float = 1.0,
        seeds: Sequence[int] | None = None,
    ) -> Rationales:
        """Each prompt's rationale token ids, the EOS id that ended it, and whether it was truncated.

        A rationale ends before the first of ``eos_token_ids`` (not included) and stops only
        there or at ``max_new_tokens``; ``truncated`` is True where it hit a length limit without
        an EOS token (``max_new_tokens``, or the model's context length). Greedy unless
        ``do_sample``; ``temperature`` is one for all rows or one a row (a row at 0 is greedy),
        so one call serves rows of several temperatures. With ``seeds`` (one a prompt) each
        sampled row is reproducible, though vLLM's random stream is not torch's, so sampled
        rationales differ from the HF backend's. Results are in the order of ``prompts``.
        """
        prompts = [[int(token) for token in row] for row in prompts]
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        temperatures = per_row(temperature, len(prompts)) if do_sample else [0.0] * len(prompts)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        stop = sorted({int(token) for token in eos_token_ids})
        if not stop:
            raise ValueError("eos_token_ids is empty: a rationale could only end at the length limit")
        if any(not row for row in prompts):
            raise ValueError("an empty prompt: every prompt holds at least the chat template's tokens")
        if not prompts:
            return Rationales([], [], [])
        if max_new_tokens == 0:
            # what generate_rollouts reports: nothing generated, nothing truncated
            return Rationales([[] for _ in prompts], [-1] * len(prompts), [False] * len(prompts))

        sampling_params = _sampling_params_class()
        params = [
            _sampling_params(sampling_params, t, top_p, None if seeds is None else seeds[i], max_new_tokens, stop)
            for i, t in enumerate(temperatures)
        ]
        outputs = self.llm.generate(
            [{"prompt_token_ids": row} for row in prompts],  # a vllm.inputs.TokensPrompt
            sampling_params=params,
            use_tqdm=False,
        )
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        result = Rationales([], [], [])
        for index, output in enumerate(outputs):
            ids, stop_id, truncated = _read_completion(index, output.outputs[0], set(stop))
            result.rationale_ids.append(ids)
            result.stop_ids.append(stop_id)
            result.truncated.append(truncated)
        return result


def _sampling_params(
    sampling_params, temperature: float, top_p: float, seed: int | None, max_new_tokens: int, stop: list[int]
):
    """One row's vLLM ``SamplingParams`` (``sampling_params`` is the class)."""
    return sampling_params(
        n=1,
        # temperature 0 is vLLM's greedy decoding (top-p and the seed are then unused)
        temperature=temperature,
        top_p=float(top_p) if temperature > 0 else 1.0,
        seed=int(seed) % 2**63 if temperature > 0 and seed is not None else None,
        max_tokens=max_new_tokens,
        # Stop on exactly our EOS set, as the HF backend does: ignore_eos drops vLLM's own
        # choice (the tokenizer's EOS plus generation_config's), stop_token_ids still apply.
        stop_token_ids=stop,
        ignore_eos=True,
        detokenize=False,
    )


def _read_completion(index: int, completion, stop: set[int]) -> tuple[list[int], int, bool]:
    """(rationale ids, the EOS id that ended it or -1, truncated) of one vLLM completion."""
    tokens = [int(token) for token in completion.token_ids]
    # vLLM keeps the stop token in token_ids; cutting at the first one is right either way.
    cut = next((i for i, token in enumerate(tokens) if token in stop), None)
    reason = completion.finish_reason
    if cut is not None:
        return tokens[:cut], tokens[cut], False
    if reason == "stop":  # ended by a stop token vLLM did not return: not cut, EOS id unknown
        return tokens, -1, False
    if reason == "length":
        return tokens, -1, True
    raise RuntimeError(f"vLLM ended prompt {index} with finish_reason={reason!r}")
