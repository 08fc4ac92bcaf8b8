"""GIRCSE's soft tokens (``gircse.md``: Algorithm 1, Eqs. 1–6): the second way a model thinks.

Instead of sampling a rationale, the model feeds back its whole next-token distribution K times:
after the prompt, s_k = softmax(W h'_{k−1}) (Eq. 5, W the LM head) becomes the input embedding
d_k = Σ_i s_{k,i} e_i (Eq. 6) of the next position (Eq. 2), and the final hidden states at the K
generated positions, G (Eq. 3), are what is pooled: z_k = mean(G_1..G_k) (Eq. 4 after k steps; the
embedding is z_K). Nothing is sampled, so the result is deterministic and differentiable end to end:
:func:`soft_token_states` runs with autograd for training (:mod:`grace_training.algorithms.icr.loss`) exactly as
it runs without it for ``encode``.

Only the generated positions are pooled, as in the paper: the soft tokens are computed from the
whole prompt and carry it, and pooling the prompt too would let a 100-token text outweigh the K
steps the stepwise loss (Eq. 7) trains. With K = 0 there is nothing generated, and the prompt after
the instruction span is pooled instead (GRACE's budget-0 embedding), so per-type budgets such as
``{"document": 0}`` keep meaning "embed from the prompt alone".

The KV cache makes the K steps one incremental pass (paper Table 6): the prompt is run once, then one
position a step. The readable trace is the top tokens of each s_k with their probabilities.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grace_st.methods.base import Method
from grace_st.methods.grace import RationaleEngine
from grace_st.runtime.batch import RolloutRequest, Rollouts, Thoughts, position_ids_from_mask, prompt_pooling_mask
from grace_st.runtime.decoding import DecodeOptions, packed_linears_for, shared_prefix_length
from grace_st.runtime.model_view import ModelView
from grace_st.runtime.prefix_cache import PREFIX_STORE, prefix_key, splits_single_rows, weights_version
from grace_st.runtime.transformers_compat import cache_kwargs
from grace_st.setting import Setting, how, is_number

# K of a GIRCSE model built or loaded without a max_rationale_tokens value: the best K of the trained models' K curve
# on the dev scoreboard (docs/gircse.md; decisions/D033).
GIRCSE_DEFAULT_K = 5


@dataclass
class SoftTokens:
    """What :func:`soft_token_states` computes for a batch of left-padded prompts."""

    prompt_states: Tensor  # (B, N, H) the prompt's states at the pooled layer
    states: Tensor  # (B, K, H) G: the states at the K generated positions (Eq. 3)
    top_ids: Tensor  # (B, K, T) the T most probable tokens of each s_k (the readable trace)
    top_probs: Tensor  # (B, K, T) their probabilities

    def step_embeddings(self) -> Tensor:
        """z_k for k = 1..K (B, K, H), float32: the mean of the first k generated states (Eq. 4 after
        k steps). z_K is the embedding ``encode`` returns; Eq. 7 trains every z_k."""
        return stepwise_means(self.states)


def stepwise_means(states: Tensor) -> Tensor:
    """(B, K, H) → (B, K, H): row k is the mean of states 1..k (Eq. 4 after k steps)."""
    counts = torch.arange(1, states.shape[1] + 1, device=states.device, dtype=torch.float32)
    return states.float().cumsum(dim=1) / counts[None, :, None]


def output_logits(model, states: Tensor) -> Tensor:
    """The next-token logits of final ``states`` as the model's own forward makes them: the LM head, then the
    model's own logit processing where its config has it (Gemma 2 and 3's final soft-capping, Cohere's
    ``logit_scale``, Granite's ``logits_scaling``), so a soft token is the distribution the model predicts."""
    logits = model.get_output_embeddings()(states)
    config = model.config.get_text_config()
    if getattr(config, "logit_scale", None):
        logits = logits * config.logit_scale
    if getattr(config, "logits_scaling", None):
        logits = logits / config.logits_scaling
    if getattr(config, "final_logit_softcapping", None):
        logits = torch.tanh(logits / config.final_logit_softcapping) * config.final_logit_softcapping
    return logits


def soft_input(embedding, distribution: Tensor) -> Tensor:
    """d_k = Σ_i s_{k,i} e_i (Eq. 6), e_i the model's own input embedding of token i: its embedding table, times
    the scale its embedding layer applies (Gemma's √d), so a one-hot s_k gives exactly that token's input."""
    soft = distribution.to(embedding.weight.dtype) @ embedding.weight
    scale = getattr(embedding, "embed_scale", None)
    return soft if scale is None else soft * scale.to(soft.dtype)


def soft_token_states(
    view: ModelView,
    input_ids: Tensor,
    attention_mask: Tensor,
    steps: int,
    *,
    top: int = 5,
    temperature: float = 1.0,
    instruction_lengths: Tensor | None = None,
) -> SoftTokens:
    """K = ``steps`` soft tokens after each left-padded prompt (Algorithm 1), KV-cached; with gradient
    when autograd is on. The view's ``hidden_layer`` picks the states pooled (-1: the decoder's final, normed
    states, the paper's); the soft token is always made from the final states through the LM head
    (:func:`output_logits`), its distribution sharpened (``temperature`` < 1) or flattened (> 1).
    ``instruction_lengths`` (L_sys a row), with the view's options' ``prefix_cache``: the prompts' shared instruction
    prefix comes from :mod:`grace_st.runtime.prefix_cache` (autograd off, float32 weights, K = 0)."""
    model, hidden_layer, options = view.model, view.hidden_layer, view.options
    decoder = model.get_decoder()
    embedding = model.get_input_embeddings()
    cache = _new_cache(model)
    positions = position_ids_from_mask(attention_mask)
    # Soft tokens feed each step's whole distribution back, so float32 rounding in the prompt grows over K steps
    # (batch 64 against 1 differs by 1e-2 on the tests' tiny model): the prefix is cached only at K = 0.
    spans = instruction_lengths if steps == 0 else None
    final, pooled, mask = _prompt_pass(model, hidden_layer, cache, input_ids, attention_mask, spans, options)
    prompt_states = pooled
    last = final[:, -1]
    next_position = positions[:, -1:] + 1
    states, top_ids, top_probs = [], [], []
    for _ in range(steps):
        logits = output_logits(model, last).float()
        distribution = torch.softmax(logits / temperature, dim=-1)  # s_k (Eq. 5); / 1 is exact
        soft = soft_input(embedding, distribution)[:, None, :]  # d_k (Eq. 6)
        probs, ids = distribution.detach().topk(min(top, distribution.shape[-1]), dim=-1)
        top_ids.append(ids)
        top_probs.append(probs)
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        final, pooled = _decode(
            decoder, hidden_layer, cache, inputs_embeds=soft, attention_mask=mask, position_ids=next_position
        )
        states.append(pooled[:, -1])
        last = final[:, -1]
        next_position = next_position + 1
    batch, hidden = input_ids.shape[0], prompt_states.shape[-1]
    empty_trace = torch.zeros((batch, 0, top), dtype=torch.long, device=input_ids.device)
    return SoftTokens(
        prompt_states,
        torch.stack(states, dim=1) if states else prompt_states.new_zeros((batch, 0, hidden)),
        torch.stack(top_ids, dim=1) if steps else empty_trace,
        torch.stack(top_probs, dim=1) if steps else empty_trace.float(),
    )


@dataclass
class SoftTokenRollouts(Rollouts):
    """A rationale's :class:`~grace_st.runtime.generation.Rollouts` made of soft tokens, with the soft tokens."""

    soft: SoftTokens | None = None


def soft_token_rollouts(soft: SoftTokens, attention_mask: Tensor, instruction_lengths: Tensor) -> SoftTokenRollouts:
    """The soft tokens in the layout of a rationale's :class:`~grace_st.runtime.generation.Rollouts` (prompt
    left-padded, then the K generated positions), so ``encode``'s outputs, the rationale cache and
    training read them as they read a rationale: ``rationale_ids`` is each step's most probable token
    (the trace's first column), nothing is truncated, nothing stopped at an EOS. The pooling mask is
    the K generated positions, or the prompt after L_sys when K = 0."""
    batch, steps = soft.states.shape[:2]
    generated = attention_mask.new_ones((batch, steps))
    if steps:
        pooling = torch.cat([torch.zeros_like(attention_mask), generated], dim=1)
    else:
        pooling = prompt_pooling_mask(attention_mask, instruction_lengths) & attention_mask.bool()
    return SoftTokenRollouts(
        attention_mask=torch.cat([attention_mask, generated], dim=1),
        pooling_mask=pooling.long(),
        token_embeddings=torch.cat([soft.prompt_states, soft.states.to(soft.prompt_states.dtype)], dim=1),
        rationale_ids=soft.top_ids[..., 0] if steps else attention_mask.new_zeros((batch, 0)),
        truncated=torch.zeros(batch, dtype=torch.bool, device=attention_mask.device),
        stop_ids=torch.full((batch,), -1, dtype=torch.long, device=attention_mask.device),
        soft=soft,
    )


def _new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _prompt_pass(
    model, hidden_layer: int, cache, input_ids: Tensor, attention_mask: Tensor, spans: Tensor | None,
    options: DecodeOptions | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The prompts' pass into ``cache``: (final states of the fed columns, whose last is each row's last prompt
    token; states at ``hidden_layer`` in the prompts' layout; the mask over the cache's columns).

    With the prefix cache the shared instruction prefix's keys and values are copied in from the store and only
    the rest is fed, padding then between prefix and text (masked; positions from the mask), as
    :class:`~grace_st.runtime.decoding.IncrementalDecoder`'s shared prefix. PyTorch's kernels then see other
    shapes: float32 rounding (tests/test_prefix_cache.py bounds it)."""
    decoder = model.get_decoder()
    shared = 0
    if spans is not None and options is not None and options.prefix_cache and not torch.is_grad_enabled():
        if splits_single_rows(model):
            shared = shared_prefix_length(input_ids, attention_mask, spans.to(input_ids.device), alone=True)
    if not shared:
        positions = position_ids_from_mask(attention_mask)
        final, pooled = _decode(
            decoder, hidden_layer, cache, input_ids=input_ids, attention_mask=attention_mask, position_ids=positions
        )
        return final, pooled, attention_mask
    batch, width = input_ids.shape
    starts = width - attention_mask.sum(1)
    first = int(starts[0])
    prefix_ids = input_ids[:1, first : first + shared]
    key, version = prefix_key(prefix_ids, hidden_layer, options, False), weights_version(model)
    entry = PREFIX_STORE.lookup(model, key, version)
    if entry is None:
        prefix_cache = _new_cache(model)
        positions = torch.arange(shared, device=input_ids.device)[None, :]
        _, prefix_states = _decode(
            decoder, hidden_layer, prefix_cache, input_ids=prefix_ids, attention_mask=torch.ones_like(prefix_ids),
            position_ids=positions,
        )
        layers = [(layer.keys, layer.values) for layer in prefix_cache.layers]
        PREFIX_STORE.store(model, key, version, layers, prefix_states)
    else:
        layers, prefix_states = entry.layers, entry.states
    for index, (keys, values) in enumerate(layers):
        cache.update(keys.expand(batch, -1, -1, -1), values.expand(batch, -1, -1, -1), index)
    rest_mask = (torch.arange(width - shared, device=input_ids.device)[None, :] >= starts[:, None]).long()
    cache_mask = torch.cat([rest_mask.new_ones((batch, shared)), rest_mask], 1)
    final, rest_states = _decode(
        decoder, hidden_layer, cache, input_ids=input_ids[:, shared:], attention_mask=cache_mask,
        position_ids=(cache_mask.cumsum(-1)[:, shared:] - 1).clamp(min=0),
    )
    pooled = rest_states.new_zeros((batch, width, rest_states.shape[-1]))
    pooled[:, shared:] = rest_states
    columns = (starts[:, None] + torch.arange(shared, device=input_ids.device)[None, :])[..., None]
    pooled.scatter_(1, columns.expand(-1, -1, pooled.shape[-1]), prefix_states.to(pooled.dtype).expand(batch, -1, -1))
    return final, pooled, cache_mask


def _decode(decoder, hidden_layer: int, cache, **inputs) -> tuple[Tensor, Tensor]:
    """One decoder pass that extends ``cache``: (final normed states, states at ``hidden_layer``)."""
    inputs.update(cache_kwargs(decoder, cache))
    if hidden_layer == -1:
        final = decoder(**inputs, use_cache=True).last_hidden_state
        return final, final
    output = decoder(**inputs, use_cache=True, output_hidden_states=True)
    return output.last_hidden_state, output.hidden_states[hidden_layer]


class SoftTokenEngine(RationaleEngine):
    """A causal LM that thinks in K soft tokens and pools their states (GIRCSE, ``gircse.md``): the same
    two calls as :class:`RationaleEngine`, a request's ``max_new_tokens`` read as K. Deterministic:
    temperatures, seeds and top-p do not apply, and a token generator (vLLM) cannot make soft tokens."""

    # how many of each step's most probable tokens the trace keeps (``explain``)
    trace_width = 5
    ragged = False

    def __init__(
        self,
        model,
        tokenizer,
        *,
        hidden_layer: int = -1,
        options: DecodeOptions | None = None,
        generator=None,
        temperature: float = 1.0,
    ):
        if generator is not None:
            raise ValueError("method 'gircse' feeds back soft tokens, which a token generator (vLLM) cannot make; use_hf()")
        super().__init__(model, tokenizer, hidden_layer=hidden_layer, options=options)
        self.temperature = temperature  # of each fed-back distribution (the setting soft_token_temperature)

    def embed(self, request: RolloutRequest, thoughts: Thoughts, batch_size: int | None = None) -> Tensor:
        """z_K of each row (Eq. 4: the mean of the K generated states; K = 0, the prompt after L_sys), (R, H)."""
        if request.max_new_tokens == 0:
            return super().embed(request, thoughts, batch_size)
        pooled = None
        for chunk, rollouts in thoughts.chunks:
            last = rollouts.soft.step_embeddings()[:, -1]
            if pooled is None:
                pooled = last.new_zeros((len(request.prompt_ids), last.shape[-1]))
            pooled[chunk] = last
        return pooled if pooled is not None else torch.zeros((0, self.hidden_size))

    def step_embeddings(self, input_ids: Tensor, attention_mask: Tensor, steps: int) -> Tensor:
        """z_1..z_K of left-padded prompts (B, K, H), **with** gradient: what Eq. 7 trains
        (:mod:`grace_training.algorithms.icr.loss`), by the computation :meth:`embed` returns the last of."""
        soft = soft_token_states(self.view, input_ids, attention_mask, steps, temperature=self.temperature)
        return soft.step_embeddings()

    def _rollout(self, request: RolloutRequest, chunk: list[int]) -> Rollouts:
        """K soft tokens after each prompt of ``chunk`` (Eqs. 2, 5, 6), laid out as a rationale's rollout."""
        device = next(self.model.parameters()).device
        input_ids, attention_mask = self._left_padded(request, chunk)
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        spans = torch.tensor([request.instruction_lengths[i] for i in chunk], device=device)
        # the packed CPU kernels, as a rationale's rollout uses them (a no-op while autograd is on)
        with packed_linears_for(self.model, self.options):
            soft = soft_token_states(
                self.view, input_ids, attention_mask, request.max_new_tokens, top=self.trace_width,
                temperature=self.temperature, instruction_lengths=spans,
            )
        return soft_token_rollouts(soft, attention_mask, spans)


def soft_token_trace(tokenizer, item: Mapping[str, Any]) -> list[list[tuple[str, float]]] | None:
    """Each soft token's most probable tokens, as (text, probability), step by step; None without a trace (a text
    answered from the rationale cache)."""
    if "soft_token_ids" not in item:
        return None
    ids, probs = item["soft_token_ids"].tolist(), item["soft_token_probs"].tolist()
    return [
        [(tokenizer.decode([token]), round(float(p), 4)) for token, p in zip(step_ids, step_probs)]
        for step_ids, step_probs in zip(ids, probs)
    ]


def _rules(values: Mapping[str, Any]) -> list[str]:
    """GIRCSE's combinations: nothing sampled or penalised under it, and its temperature and reference prompt format
    under no other method."""
    method = values.get("method", "grace")
    mine, problems = method == "gircse", []
    if mine and values.get("do_sample", False):
        problems.append("method 'gircse' samples nothing (its soft tokens are the whole distribution): set do_sample=False")
    if values.get("prompt_format", "chat") == "instruct" and not mine:
        problems.append(
            "prompt_format 'instruct' is GIRCSE's reference format (soft tokens right after the text); "
            f"method {method!r} thinks in the chat template's assistant turn: use prompt_format 'chat'"
        )
    if values.get("soft_token_temperature", 1.0) != 1.0 and not mine:
        problems.append("soft_token_temperature is GIRCSE's (method 'gircse'); a rationale's is temperature")
    if mine and values.get("repetition_penalty", 1.0) != 1.0:
        problems.append(
            "method 'gircse' writes no tokens to penalise (it feeds back soft tokens): set repetition_penalty=1"
        )
    return problems


GIRCSE = Method(
    "gircse",
    SoftTokenEngine,
    "feeds its next-token distribution back as max_rationale_tokens soft tokens and pools their states "
    "(GIRCSE: deterministic, nothing sampled)",
    settings={
        "soft_token_temperature": Setting(
            1.0,
            "method 'gircse': the temperature of each fed-back distribution, softmax(logits / T); 1 is the paper's",
            "a finite number > 0",
            lambda v: is_number(v) and v > 0,
            **how("float"),
        ),
    },
    engine_options=lambda settings, state: {"temperature": settings["soft_token_temperature"]},
    rules=_rules,
    default_budget=GIRCSE_DEFAULT_K,
    budget_note=(
        f"Method 'gircse' reads it as K, the soft tokens, and a GIRCSE model built or loaded without a value gets "
        f"K = {GIRCSE_DEFAULT_K} (measured: docs/gircse.md)"
    ),
    trace=lambda tokenizer, item: {"soft_tokens": soft_token_trace(tokenizer, item)},
    vllm=False,
    vllm_refusal="feeds back soft tokens",
    shipped_adapter="gircse",
    trained_by="icr",
)
