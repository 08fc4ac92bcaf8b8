"""RationaleEngine: where a GRACE model thinks and embeds (method.md §1, Eqs. 1–3), for ``encode``
and for training alike.

``GenerativeEncoder.forward`` (what ``encode`` runs), training's rollouts
(:mod:`grace_training.algorithms.grpo.rollout`), the vLLM rollout backend and the rationale cache all reach the
model through the same two calls:

- :meth:`RationaleEngine.generate`: a :class:`RolloutRequest` (prompts ``P(x)``, their L_sys, a
  temperature and seed a row, a token budget) → :class:`Thoughts`, the rationales (Eqs. 1–2);
- :meth:`RationaleEngine.embed`: the request and its thoughts → the pooled states h (Eq. 3), (R, H).

So the embedding a rollout is rewarded for and the one ``encode`` returns are one computation
by construction (``test_rollout_embedding_is_encode_embedding``).

Backends. The HF one-pass rollout (:func:`grace_st.runtime.generation.generate_rollouts`) keeps the hidden
states it decodes with: :meth:`embed` pools those, no second pass. A token generator (vLLM,
:class:`grace_st.runtime.vllm_backend.VLLMRationaleGenerator`) returns ids only: :meth:`embed` then runs one
no-gradient HF pass over ``P(x) ⊕ r`` (:func:`grace_st.runtime.second_pass.pooled_embeddings`), the same
states since the model is causal.

Another way of thinking is one more class with the same two calls: :class:`SoftTokenEngine` (GIRCSE,
``gircse.md``, Eqs. 2–6) feeds the LM head's distribution back as an input embedding K times
(:mod:`grace_st.methods.gircse`) and returns :class:`Thoughts` with the K states and a readable trace
(the top tokens of each step) instead of sampled ids; its ``embed`` pools the generated states
(Eq. 4). :class:`LatentEngine` (GRC, ``grc.md``) writes a response as GRACE does, then embeds with the final
states of learned latent tokens that follow it (:mod:`grace_st.methods.grc`). Each module declares its method's
record (:class:`~grace_st.methods.base.Method`: :data:`GRACE` here); the encoder picks the engine class by its saved
``method`` setting through :data:`grace_st.methods.registry.METHODS`; nothing that calls ``generate``/``embed`` changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from grace_st.methods.base import Method
from grace_st.runtime.batch import (
    Rationales,
    RolloutRequest,
    Rollouts,
    Thoughts,
    left_pad,
    masked_mean,
    position_ids_from_mask,
    prompt_pooling_mask,
)
from grace_st.runtime.decoding import DecodeOptions, continuous_batching, decoder_states
from grace_st.runtime.generation import RolloutSettings, generate_rollouts, stream_rollouts
from grace_st.runtime.model_view import ModelView
from grace_st.runtime.second_pass import pooled_embeddings, right_padded_states  # noqa: F401 (training reaches it here)


def length_buckets(lengths: Sequence[int], batch_size: int, ratio: float | None = 1.5, min_rows: int = 8) -> list[list[int]]:
    """Row indices in chunks of at most ``batch_size``, shortest prompts first. With ``ratio``, a
    chunk of at least ``min_rows`` also closes where the next prompt is over ``ratio`` times its
    shortest: a batch of 20-token sentences and 128-token abstracts is prefilled as two, not padded
    to 128, at the price of one decoding pass a chunk at every step (at the shipped settings that
    price was the larger: off by default, decisions/D008)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    chunks: list[list[int]] = []
    for i in order:
        current = chunks[-1] if chunks else None
        full = current is not None and len(current) >= batch_size
        uneven = (
            current is not None and ratio is not None and len(current) >= min_rows
            and lengths[i] > ratio * max(lengths[current[0]], 1)
        )
        if current is None or full or uneven:
            chunks.append([i])
        else:
            current.append(i)
    return chunks


class RationaleEngine:
    """A causal LM that writes rationales and pools its states (GRACE, method.md §1).

    A view over the model it is given: it holds no weights of its own, so an encoder builds one when
    asked (``GenerativeEncoder.engine``) and every caller sees the current model, adapter and settings. What the
    runtime reads of the model (the layer pooled, the pad and stop ids, the decode options) is its :attr:`view`
    (:class:`~grace_st.runtime.model_view.ModelView`), handed down whole.

    Args:
        model: the causal LM (a PEFT model for a LoRA adapter).
        tokenizer: its tokenizer (EOS and pad ids).
        hidden_layer: the states pooled: -1 the decoder's final (normed) states, else an index into
            transformers' ``hidden_states``.
        options: how the HF rollout feeds the model (:class:`~grace_st.runtime.decoding.DecodeOptions`; speed only).
        generator: a token generator (``generate(prompts, max_new_tokens=, eos_token_ids=, do_sample=,
            temperature=, top_p=, seeds=) -> Rationales``, e.g. vLLM's) in place of the HF one-pass rollout.
    """

    def __init__(self, model, tokenizer, *, hidden_layer: int = -1, options: DecodeOptions | None = None, generator=None):
        self.tokenizer = tokenizer
        self.generator = generator
        self.view = self._view(model, hidden_layer, options or DecodeOptions())

    def _view(self, model, hidden_layer: int, options: DecodeOptions) -> ModelView:
        """The model with its stop ids (the tokenizer's EOS and the generation config's) and pad id (the
        tokenizer's, else the first stop id)."""
        ids = {self.tokenizer.eos_token_id}
        generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ids.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
        eos = tuple(sorted(i for i in ids if i is not None))
        pad = self.tokenizer.pad_token_id
        return ModelView(model, hidden_layer, pad if pad is not None else eos[0], eos, options)

    @property
    def model(self):
        return self.view.model

    @model.setter
    def model(self, model) -> None:
        self.view = self._view(model, self.view.hidden_layer, self.view.options)

    @property
    def hidden_layer(self) -> int:
        return self.view.hidden_layer

    @property
    def options(self) -> DecodeOptions:
        return self.view.options

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends a rationale: the tokenizer's EOS and the generation config's."""
        return list(self.view.eos_token_ids)

    @property
    def pad_token_id(self) -> int:
        return self.view.pad_token_id

    @property
    def hidden_size(self) -> int:
        return self.model.config.get_text_config().hidden_size

    # -- the two calls ---------------------------------------------------------------------------

    def generate(self, request: RolloutRequest, batch_size: int | None = None, bucket_ratio: float | None = None) -> Thoughts:
        """A rationale for each row (Eqs. 1–2). The HF rollout runs the rows in one pass, in order, when
        ``batch_size`` is None (``encode``'s batch), else in chunks of similar prompt length
        (:func:`length_buckets`); each row has its own seed, so chunking does not change what is sampled."""
        if self.generator is not None:
            if request.repetition_penalty != 1.0:
                # vLLM's repetition_penalty counts the prompt's tokens too: another rationale than the HF rollout's
                raise ValueError(
                    f"repetition_penalty {request.repetition_penalty} needs the HF rollout: vLLM's penalty also "
                    "counts the text's tokens; set repetition_penalty=1 or turn vLLM off (use_hf)"
                )
            temperatures = request.temperatures
            return Thoughts(
                self.generator.generate(
                    request.prompt_ids,
                    max_new_tokens=request.max_new_tokens,
                    eos_token_ids=self.eos_token_ids,
                    do_sample=any(t > 0 for t in temperatures),
                    temperature=temperatures,
                    top_p=request.top_p,
                    seeds=request.seeds,
                )
            )
        rows = len(request.prompt_ids)
        if batch_size is None and self._streams(request):
            return Thoughts(*self._stream(request))
        if batch_size is None:
            chunks = [list(range(rows))] if rows else []
        else:
            chunks = length_buckets([len(p) for p in request.prompt_ids], batch_size, bucket_ratio)
        rationales = Rationales([[] for _ in range(rows)], [-1] * rows, [False] * rows)
        made = []
        for chunk in chunks:
            rollouts = self._rollout(request, chunk)
            for field_values, values in zip(rationales, rollouts.rationales()):
                for row, i in enumerate(chunk):
                    field_values[i] = values[row]
            made.append((chunk, rollouts))
        return Thoughts(rationales, made)

    def embed(self, request: RolloutRequest, thoughts: Thoughts, batch_size: int | None = None) -> Tensor:
        """h of each row (Eq. 3): the mean of the states of ``P(x) ⊕ r`` after L_sys, (R, H) float32.
        Pools the states the rollout kept; for ids alone (a token generator), one no-gradient HF pass
        (``batch_size`` rows at a time, by length; None: one batch)."""
        if not thoughts.chunks and request.prompt_ids:
            return pooled_embeddings(
                self.view, request.prompt_ids, request.instruction_lengths, thoughts.rationales.rationale_ids,
                batch_size=batch_size,
            )
        whole = thoughts.single_pass()
        if whole is not None:  # one pass in request order (encode's batch): as it is, on the model's device
            return masked_mean(whole.token_embeddings, whole.pooling_mask)
        pooled = torch.zeros((len(request.prompt_ids), self.hidden_size))
        for chunk, rollouts in thoughts.chunks:
            pooled[chunk] = masked_mean(rollouts.token_embeddings, rollouts.pooling_mask).cpu()
        return pooled

    def embed_prompts(
        self, input_ids: Tensor, attention_mask: Tensor, instruction_lengths: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Eq. 3 over left-padded prompts alone (budget 0), **with** gradient: the pass the InfoNCE
        baseline trains (:mod:`grace_training.algorithms.infonce`), and the states it pooled. The positions a budget-0
        rollout pools."""
        states = decoder_states(
            self.view, input_ids=input_ids, attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
        )
        return masked_mean(states, prompt_pooling_mask(attention_mask, instruction_lengths)), states

    # -- the HF one-pass rollout -----------------------------------------------------------------

    def rollout_settings(self, do_sample: bool, top_p: float, repetition_penalty: float) -> RolloutSettings:
        """How the rows decoded together draw their tokens (the server's scheduler builds its stream's settings
        here too); the rest of what they share is this engine's :attr:`view`."""
        return RolloutSettings(do_sample=do_sample, top_p=top_p, repetition_penalty=repetition_penalty)

    def _request_settings(self, request: RolloutRequest, temperatures: Sequence[float]) -> RolloutSettings:
        """Sampling is on when any of ``temperatures`` (the rows decoded together) is above 0."""
        return self.rollout_settings(any(t > 0 for t in temperatures), request.top_p, request.repetition_penalty)

    # Rationales end at different lengths: a call over more rows than ``options.decode_rows``
    # streams them through that many (continuous batching). Soft tokens all run K steps: they do not.
    ragged = True
    # The states a rollout decodes with are what ``embed`` pools, so a stream of rows (the server's scheduler) may
    # embed each row as it ends. GRC's embedding is its latents': its rows are embedded by ``embed``.
    embeds_decoding_states = True

    def _streams(self, request: RolloutRequest) -> bool:
        slots = self.options.decode_rows
        return (
            self.ragged and slots is not None and len(request.prompt_ids) > slots and request.max_new_tokens > 0
            and continuous_batching(self.model, self.options)
        )

    def _stream(self, request: RolloutRequest) -> tuple[Rationales, list[tuple[list[int], Rollouts]]]:
        """Every row through ``options.decode_rows`` slots (:func:`~grace_st.runtime.generation.stream_rollouts`): one
        :class:`Rollouts` in request order, as one pass would give."""
        rollouts = stream_rollouts(
            self.view,
            request.prompt_ids,
            request.instruction_lengths,
            self._request_settings(request, request.temperatures),
            slots=self.options.decode_rows,
            max_new_tokens=request.max_new_tokens,
            temperature=request.temperatures,
            seeds=request.seeds,
            device=next(self.model.parameters()).device,
        )
        return rollouts.rationales(), [(list(range(len(request.prompt_ids))), rollouts)]

    def _left_padded(self, request: RolloutRequest, chunk: list[int]) -> tuple[Tensor, Tensor]:
        """The prompts of ``chunk`` left-padded: the request's own padding when the chunk is every row."""
        if request.padded is not None and chunk == list(range(len(request.prompt_ids))):
            return request.padded
        return left_pad([request.prompt_ids[i] for i in chunk], self.pad_token_id)

    def _rollout(self, request: RolloutRequest, chunk: list[int]) -> Rollouts:
        device = next(self.model.parameters()).device
        input_ids, attention_mask = self._left_padded(request, chunk)
        temperatures = [request.temperatures[i] for i in chunk]
        return generate_rollouts(
            self.view,
            input_ids.to(device),
            attention_mask.to(device),
            torch.tensor([request.instruction_lengths[i] for i in chunk], device=device),
            self._request_settings(request, temperatures),
            max_new_tokens=request.max_new_tokens,
            temperature=temperatures,
            seeds=None if request.seeds is None else [request.seeds[i] for i in chunk],
        )


GRACE = Method(
    "grace",
    RationaleEngine,
    "writes a rationale of up to max_rationale_tokens tokens and pools the text and the rationale (GRACE)",
    shipped_adapter="default",
    trained_by="grpo",
)
