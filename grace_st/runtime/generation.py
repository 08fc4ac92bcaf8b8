"""Rationales and their hidden states in one pass (method.md §1, Eqs. 1–2).

The policy is causal, so the hidden state of position t depends on tokens ≤ t only: the
states computed while a rationale is generated are exactly the states of Eq. 2 over
``P(x) ⊕ r``. :func:`generate_rollouts` keeps them as it decodes, so no second forward
pass over prompt + rationale is needed. :func:`grace_st.runtime.second_pass.two_pass_reference` is
that second pass (generate, re-encode, pool), kept as the yardstick for tests and benchmarks.
How the policy is fed (KV cache, shared prefix, packed kernels) is :mod:`grace_st.runtime.decoding`'s
business; this module is the method.

Pooled positions: the user text and template suffix (t > L_sys) and every rationale token
before the end-of-sequence token. The EOS token and anything after it, and padding, are
not pooled. A rationale cut at the length limit has its last token fed once more so its
state exists; that token is pooled like the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from grace_st.runtime.batch import Rollouts, left_pad, per_row, prompt_pooling_mask
from grace_st.runtime.decoding import IncrementalDecoder, incremental_decoder
from grace_st.runtime.model_view import ModelView


def inverse_cdf_draw(probs: Tensor, uniforms: Tensor) -> Tensor:
    """One token a row from (unnormalised) ``probs`` (rows, V), given one uniform in [0, 1) a row:
    the first token whose cumulative mass exceeds the uniform times the row's total.

    Exact sampling from ``probs`` with one random number a row. ``torch.multinomial`` draws one
    exponential per vocabulary entry (49,152 a row a token for SmolLM2: 8 % of a training step's
    rollouts, decisions/D008); this is a cumulative sum and a binary search. In float64 so that
    a token's interval is its probability to about 1e-16 and a zero-probability token (cut by
    top-p) has an empty interval, never drawn.
    """
    cdf = probs.double().cumsum(-1)
    target = uniforms.double().to(cdf.device)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def _sample(
    logits: Tensor, temperature: Tensor, top_p: float, generators: list[torch.Generator] | None, inverse_cdf: bool = True
) -> Tensor:
    """One token a row: sampled at the row's ``temperature`` (rows,), greedy where it is 0."""
    greedy = temperature <= 0
    probs = torch.softmax(logits.float() / temperature.masked_fill(greedy, 1.0)[:, None], dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the top token always survives)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    if not inverse_cdf and generators is None:
        sampled = torch.multinomial(probs, 1).squeeze(-1)
    elif not inverse_cdf:
        rows = [torch.multinomial(row.cpu(), 1, generator=gen).squeeze(-1) for row, gen in zip(probs, generators)]
        sampled = torch.stack(rows).to(logits.device)
    elif generators is None:
        sampled = inverse_cdf_draw(probs, torch.rand(len(probs), dtype=torch.float64))
    else:
        # One generator a row: a text's rationale does not depend on what it was batched with.
        sampled = inverse_cdf_draw(probs, torch.stack([torch.rand((), dtype=torch.float64, generator=g) for g in generators]))
    return torch.where(greedy, logits.argmax(-1), sampled) if greedy.any() else sampled


def penalise_repeats(logits: Tensor, written: Tensor | None, penalty: float) -> Tensor:
    """CTRL's repetition penalty (Keskar et al., 2019; transformers' ``repetition_penalty``) over the
    rationale's own tokens: where a row has already written a token (``written``, (rows, V) bool), its
    logit is divided by ``penalty`` when positive and multiplied when negative, so the token is less
    likely again. The text's own tokens are not penalised: a rationale about a text may name it.

    Why: training teaches the policy to repeat the text's topic word ("combat combat combat", the
    distinct-word share of a rationale falls from 0.78 to 0.55, decisions/D024); the penalty keeps a
    rationale readable for ``explain``."""
    if written is None or penalty == 1.0:
        return logits
    # Only the written entries change (a rationale's few dozen of 49,152 a row): penalising those alone
    # is the same arithmetic at 1/3 to 1/8 of the cost of the full-vocabulary passes (decisions/D026).
    rows, tokens = written.nonzero(as_tuple=True)
    seen = logits[rows, tokens]
    return logits.index_put((rows, tokens), torch.where(seen > 0, seen / penalty, seen * penalty))


def _written(rows: int, logits: Tensor | None, penalty: float) -> Tensor | None:
    """Which tokens each row's rationale has written so far, (rows, V) bool: None without a penalty, or
    without logits (a budget of 0 writes nothing)."""
    if penalty == 1.0 or logits is None:
        return None
    return torch.zeros((rows, logits.shape[-1]), dtype=torch.bool, device=logits.device)


@dataclass(frozen=True)
class RolloutSettings:
    """How every row of a rollout draws its tokens (Eq. 1): whether they are sampled and with which top-p, and the
    repetition penalty over each rationale's own tokens (1: none; :func:`penalise_repeats`). The model, the layer
    whose states are kept, the pad and stop ids and how the model is fed are the
    :class:`~grace_st.runtime.model_view.ModelView`'s; what differs a row (its prompt, budget, temperature and seed)
    travels with the row."""

    do_sample: bool = False
    top_p: float = 1.0
    repetition_penalty: float = 1.0


@dataclass(eq=False)
class DecodeState:
    """Eq. 1's bookkeeping over a decoder's rows (a batch's rows, or a stream's slots) from one step to the next:
    which rows have ended, each row's temperature and generator, and which tokens each rationale has written (the
    repetition penalty's). :func:`generate_rollouts` and :class:`RolloutStream` both step through
    :func:`decode_step`, so a row's rationale is one computation whichever loop decodes it (batch invariance,
    ``tests/test_batch_invariance.py``)."""

    settings: RolloutSettings
    stop_ids: Tensor  # the ids that end a rationale
    inverse_cdf: bool  # DecodeOptions.inverse_cdf_sampling
    done: Tensor  # (rows,) bool: the rationale ended, or (a stream's slot) no prompt holds the row
    temperatures: Tensor  # (rows,) float32; 0: greedy
    # one a row when seeded, so a row's draws do not depend on its batch; a None among the rows stepped: every row
    # draws from torch's global generator
    generators: list[torch.Generator | None] | None
    written: Tensor | None = None  # (rows, V) bool (_written); None without a penalty
    idle: torch.Generator | None = None  # what a stream's free slot draws with: its token is never read

    @classmethod
    def for_batch(
        cls, view: ModelView, settings: RolloutSettings, rows: int, temperature, seeds, logits, inverse_cdf, device
    ) -> DecodeState:
        """Every row decoding from the start: its temperature (one for all, or one a row), its generator when
        ``seeds`` are given and tokens are sampled, nothing written (``logits``: the prompt pass's; None at a
        budget of 0)."""
        temperatures = torch.tensor(per_row(temperature, rows), dtype=torch.float32, device=device)
        seeded = settings.do_sample and seeds is not None
        generators = [torch.Generator().manual_seed(int(s)) for s in seeds] if seeded else None
        return cls(
            settings, view.stop_ids(device), inverse_cdf, torch.zeros(rows, dtype=torch.bool, device=device),
            temperatures, generators, _written(rows, logits, settings.repetition_penalty),
        )

    @classmethod
    def for_slots(cls, view: ModelView, settings: RolloutSettings, rows: int, inverse_cdf, device) -> DecodeState:
        """``rows`` slots no prompt holds yet (:meth:`occupy`)."""
        state = cls(
            settings, view.stop_ids(device), inverse_cdf, torch.ones(0, dtype=torch.bool, device=device),
            torch.zeros(0, device=device), [], idle=torch.Generator(),
        )
        state.add_rows(rows)
        return state

    def add_rows(self, count: int) -> None:
        """``count`` more free slots."""
        self.done = torch.cat([self.done, self.done.new_ones(count)])
        self.temperatures = torch.cat([self.temperatures, self.temperatures.new_zeros(count)])
        self.generators += [self.idle] * count
        if self.written is not None:
            self.written = torch.cat([self.written, self.written.new_zeros((count, self.written.shape[-1]))])

    def occupy(self, slots: Tensor, temperatures: Sequence[float], generators, logits: Tensor) -> None:
        """New rows in ``slots``: their temperatures and generators, nothing written yet (``logits``: the slots'
        logits, whose width the written tokens take at the first call)."""
        self.done[slots] = False
        self.temperatures[slots] = torch.tensor(temperatures, dtype=torch.float32, device=self.temperatures.device)
        for slot, generator in zip(slots.tolist(), generators):
            self.generators[slot] = generator
        if self.written is None:
            self.written = _written(len(self.done), logits, self.settings.repetition_penalty)
        else:
            self.written.index_fill_(0, slots, False)

    def vacate(self, slot: int) -> None:
        """The slot's row has left: the slot is free, greedy, on the idle generator."""
        self.done[slot] = True
        self.temperatures[slot] = 0.0
        self.generators[slot] = self.idle


def _choose(logits: Tensor, rows: Tensor, state: DecodeState) -> Tensor:
    """Eq. 1 for the rows still fed: r_k ~ pi(. | P(x) + r_<k) at each row's temperature, or the argmax."""
    if not state.settings.do_sample:
        return logits.argmax(-1)
    generators = None if state.generators is None else [state.generators[i] for i in rows.tolist()]
    if generators is not None and any(generator is None for generator in generators):
        generators = None
    return _sample(logits, state.temperatures[rows], state.settings.top_p, generators, state.inverse_cdf)


def decode_step(logits: Tensor, rows: Tensor, state: DecodeState) -> tuple[Tensor, Tensor, Tensor]:
    """One step of Eq. 1 over the decoder's fed ``rows`` and their ``logits``: the repetition penalty over each
    rationale's written tokens, then a token a row. Returns the tokens, the rows they end (``stopping``: an EOS,
    the row now done) and the rows that go on (``alive``: their tokens now written); a row already done is in
    neither."""
    if state.written is not None:
        logits = penalise_repeats(logits, state.written[rows], state.settings.repetition_penalty)
    token = _choose(logits, rows, state)
    live = ~state.done[rows]
    stopping = live & torch.isin(token, state.stop_ids)
    alive = live & ~stopping
    state.done[rows[stopping]] = True
    if state.written is not None:
        state.written[rows[alive], token[alive]] = True
    return token, stopping, alive


@torch.no_grad()
def generate_rollouts(
    view: ModelView,
    input_ids: Tensor,
    attention_mask: Tensor,
    instruction_lengths: Tensor,
    settings: RolloutSettings,
    *,
    max_new_tokens: int,
    temperature: float | Sequence[float] = 1.0,
    seeds: Sequence[int] | None = None,
) -> Rollouts:
    """A rationale for each left-padded prompt, its hidden states (Eqs. 1–2) and the positions Eq. 3 pools.

    Greedy unless ``settings.do_sample``; ``temperature`` is one for every row or one a row (0: greedy), so
    a training step's queries, negatives and positives share one call; ``seeds`` (one a row) make
    sampling reproducible per text."""
    device, batch = input_ids.device, input_ids.shape[0]
    per_row(temperature, batch)  # checked before the prompt pass
    stop_ids = torch.full((batch,), -1, dtype=torch.long, device=device)
    tokens: list[Tensor] = []  # one (B,) column a step: the rationale token, -1 once the row's rationale ended
    pooled = [prompt_pooling_mask(attention_mask, instruction_lengths.to(device))]  # Eq. 3: t > L_sys

    with incremental_decoder(view) as decoder:
        states, logits = decoder.prefill(input_ids, attention_mask, instruction_lengths, max_new_tokens)
        state = DecodeState.for_batch(
            view, settings, batch, temperature, seeds, logits, decoder.options.inverse_cdf_sampling, device
        )
        all_states = [states]  # Eq. 2 over P(x)
        for _ in range(max_new_tokens):
            rows = decoder.rows  # the rows still fed; logits are theirs
            token, stopping, alive = decode_step(logits, rows, state)  # Eq. 1
            stop_ids[rows[stopping]] = token[stopping]
            if state.done.all():
                break
            step_tokens = torch.full((batch,), -1, dtype=torch.long, device=device)
            step_tokens[rows[alive]] = token[alive]
            tokens.append(step_tokens)
            states, logits = decoder.step(token, alive)
            all_states.append(states)  # Eq. 2 over r_k, pooled where the rationale goes on
            pooled.append((step_tokens >= 0)[:, None])

    rationale_ids = torch.stack(tokens, 1) if tokens else torch.empty((batch, 0), dtype=torch.long, device=device)
    return Rollouts(
        attention_mask=torch.cat([attention_mask, (rationale_ids >= 0).long()], 1),
        pooling_mask=torch.cat(pooled, 1),
        token_embeddings=torch.cat(all_states, 1),
        rationale_ids=rationale_ids,
        truncated=~state.done if max_new_tokens > 0 else torch.zeros_like(state.done),
        stop_ids=stop_ids,
    )


@dataclass
class StreamedRow:
    """One prompt's rollout in a :class:`RolloutStream`: its prompt's states (real tokens only), the
    rationale written (Eq. 1) and its tokens' states (Eq. 2), and how it ended."""

    key: object
    prompt_ids: list[int]
    instruction_length: int
    max_new_tokens: int
    temperature: float = 0.0
    generator: torch.Generator | None = None
    prompt_states: Tensor | None = None  # (prompt length, H)
    rationale_ids: list[int] = field(default_factory=list)
    rationale_states: list[Tensor] = field(default_factory=list)  # one (H,) a rationale token
    stop_id: int = -1  # the EOS that ended it; -1 if none
    truncated: bool = False  # ended at its budget without an EOS

    def pooling_mask(self) -> Tensor:
        """Eq. 3's positions over ``P(x) ⊕ r``: after L_sys, every rationale token."""
        positions = torch.arange(len(self.prompt_ids) + len(self.rationale_ids))
        return positions >= self.instruction_length

    def token_embeddings(self) -> Tensor:
        """The states of ``P(x) ⊕ r``, (prompt length + rationale length, H)."""
        return torch.cat([self.prompt_states, *(state[None] for state in self.rationale_states)])


class RolloutStream:
    """Continuous batching as a loop its caller drives (Eqs. 1–2): rows join with :meth:`add` at any
    time, each :meth:`step` admits waiting prompts into free decoding slots and feeds every slot one
    token, and returns the rows whose rationale ended. A row whose budget is 0 gets its prompt pass
    only, in a batch with the other such rows waiting.

    ``encode``'s stream (:func:`stream_rollouts`) and the server (:mod:`grace_st.serve.scheduler`) both run
    this loop, and a row's rollout is the same bits whatever shares the slots: every per-row
    computation (native prompt pass and step, the pooled mean) is batch-invariant
    (``tests/test_batch_invariance.py``).

    Slots: the cache holds ``slots`` rows (``slots`` may be a callable of the number of rows decoding
    and waiting), with room for twice the widest prompt and budget waiting when it was allocated. When
    more rows wait than slots are free, the cache grows to the count the callable gives; a wider
    prompt, or fewer slots, waits until the stream is empty and the cache is allocated again. Waiting prompts enter in the order added, once an eighth of the slots (at least
    one) are free, or all are.
    """

    def __init__(
        self,
        decoder: IncrementalDecoder,
        settings: RolloutSettings,
        *,
        slots,
        device: torch.device | str = "cpu",
    ):
        self.root, self.decoder, self.settings = decoder, None, settings
        self.view = decoder.view
        self.slot_policy = slots if callable(slots) else (lambda waiting, n=slots: min(n, waiting))
        self.device = device
        self.waiting: list[StreamedRow] = []
        self.slot_rows: list[StreamedRow | None] = []
        self.state = self._slots(0)  # Eq. 1's bookkeeping, a slot a row
        self.logits: Tensor | None = None
        self.capacity = 0  # the widest prompt plus budget the cache was allocated for
        self.rows_stepped = 0  # rows fed by the last step (0: it decoded nothing)
        self.rows_prefilled = 0  # rows of the last step's prompt pass for budget-0 rows (0: none ran)

    def add(self, row: StreamedRow) -> None:
        self.waiting.append(row)

    @property
    def done(self) -> Tensor:
        """(slots,) bool: which slots no decoding row holds."""
        return self.state.done

    def _slots(self, count: int) -> DecodeState:
        inverse_cdf = self.root.options.inverse_cdf_sampling
        return DecodeState.for_slots(self.view, self.settings, count, inverse_cdf, self.device)

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or not bool(self.done.all())

    def drop(self, keys) -> None:
        """Rows no longer wanted (a client gone): out of the queue, their slots freed."""
        keys = set(keys)
        self.waiting = [row for row in self.waiting if row.key not in keys]
        for slot, row in enumerate(self.slot_rows):
            if row is not None and row.key in keys and not self.done[slot]:
                self._finish(slot)

    def step(self) -> list[StreamedRow]:
        """Admit, then one decoding step: the rows that ended, each once."""
        self.rows_stepped = self.rows_prefilled = 0
        ended = self._prompt_only()
        self._admit()
        if not bool(self.done.all()):
            ended += self._decode()
        if not self.busy:
            self.close()
        return ended

    def close(self) -> None:
        """Give PyTorch back the threads a single-row step holds (:meth:`IncrementalDecoder.close`)."""
        if self.decoder is not None:
            self.decoder.close()

    # -- the parts of a step -------------------------------------------------------------------------

    def _prompt_only(self) -> list[StreamedRow]:
        rows = [row for row in self.waiting if row.max_new_tokens == 0]
        rows = rows[: max(1, self.slot_policy(len(rows)))]  # as many rows as slots at most: a bounded pass
        if not rows:
            return []
        taken = {id(row) for row in rows}
        self.waiting = [row for row in self.waiting if id(row) not in taken]
        self.rows_prefilled = len(rows)
        input_ids, attention_mask = left_pad([row.prompt_ids for row in rows], self.view.pad_token_id)
        spans = torch.tensor([row.instruction_length for row in rows], device=self.device)
        states, _ = self.root.fresh().prefill(input_ids.to(self.device), attention_mask.to(self.device), spans, 0)
        width = states.shape[1]
        for index, row in enumerate(rows):
            row.prompt_states = states[index, width - len(row.prompt_ids) :]
        return rows

    def _admit(self) -> None:
        # A row with a budget of 0 never takes a decoding slot: admitting it would feed it one token, which its
        # mean would then pool. It waits for the next step's prompt pass instead.
        decoding = [row for row in self.waiting if row.max_new_tokens > 0]
        if not decoding:
            return
        empty = bool(self.done.all())
        need = max(len(row.prompt_ids) + row.max_new_tokens for row in decoding)
        live = 0 if empty else int((~self.done).sum())
        count = max(1, self.slot_policy(live + len(decoding)))
        if empty and (self.decoder is None or need > self.capacity or count != len(self.done)):
            # a new cache, sized for what waits now
            self.close()
            self.decoder, self.capacity = self.root.fresh(), need
            self.slot_rows, self.state, self.logits = [None] * count, self._slots(count), None
        elif count > len(self.done) and not empty:  # more waiting than slots free: more slots, same cache
            # at least doubled (to the most the policy allows): a copy of the cache a doubling, not a row
            extra = max(count, min(2 * len(self.done), self.slot_policy(1 << 30))) - len(self.done)
            self.decoder.add_slots(extra)
            self.slot_rows += [None] * extra
            self.state.add_rows(extra)
            self.logits = torch.cat([self.logits, self.logits.new_zeros((extra, self.logits.shape[-1]))])
        if not (bool(self.done.all()) or int(self.done.sum()) >= max(1, len(self.done) // 8)):
            return
        free = self.done.nonzero().squeeze(1).tolist()
        rows = []
        for row in decoding:
            if len(rows) == len(free):
                break
            if len(row.prompt_ids) + row.max_new_tokens <= self.capacity:
                rows.append(row)
                self.waiting.remove(row)
        if not rows:
            return
        slots = torch.tensor(free[: len(rows)], dtype=torch.long, device=self.device)
        input_ids, attention_mask = left_pad([row.prompt_ids for row in rows], self.view.pad_token_id)
        states, new_logits = self.decoder.admit(
            slots, input_ids.to(self.device), attention_mask.to(self.device),
            torch.tensor([row.instruction_length for row in rows], device=self.device), len(self.done),
            self.capacity - input_ids.shape[1],  # the cache: twice the widest prompt and budget, plus a column
        )
        width = states.shape[1]
        for index, (slot, row) in enumerate(zip(slots.tolist(), rows)):
            row.prompt_states = states[index, width - len(row.prompt_ids) :]
            self.slot_rows[slot] = row
        if self.logits is None:  # slots no prompt holds yet: logits never read (their rows are done)
            self.logits = new_logits.new_zeros((len(self.done), new_logits.shape[-1]))
        self.logits = self.logits.index_copy(0, slots, new_logits)
        self.state.occupy(slots, [row.temperature for row in rows], [row.generator for row in rows], self.logits)

    def _decode(self) -> list[StreamedRow]:
        slot_rows = self.decoder.rows  # the slots fed; logits are theirs
        token, stopping, alive = decode_step(self.logits, slot_rows, self.state)  # Eq. 1
        ended = []
        for slot, stop in zip(slot_rows[stopping].tolist(), token[stopping].tolist()):
            self.slot_rows[slot].stop_id = stop
            ended.append(self._finish(slot))
        if not alive.any():
            return ended
        # finished slots stay in the cache (keep_rows): a later prompt takes them
        states, self.logits = self.decoder.step(token, alive, keep_rows=True)
        self.rows_stepped = int(alive.sum())
        fed_slots, fed_tokens = slot_rows[alive], token[alive]
        for slot, tok in zip(fed_slots.tolist(), fed_tokens.tolist()):
            row = self.slot_rows[slot]
            row.rationale_ids.append(tok)
            row.rationale_states.append(states[slot, 0])  # Eq. 2 over r_k
            if len(row.rationale_ids) >= row.max_new_tokens:
                row.truncated = True
                ended.append(self._finish(slot))
        return ended

    def _finish(self, slot: int) -> StreamedRow:
        self.state.vacate(slot)
        self.decoder.release(torch.tensor([slot], device=self.device))
        row, self.slot_rows[slot] = self.slot_rows[slot], None
        return row


def streamed_row(key, prompt_ids, instruction_length, max_new_tokens, temperature=0.0, seed=None) -> StreamedRow:
    """A :class:`StreamedRow` with its own generator when seeded (its draws then do not depend on its batch)."""
    generator = torch.Generator().manual_seed(int(seed)) if seed is not None else None
    return StreamedRow(key, list(prompt_ids), int(instruction_length), int(max_new_tokens), float(temperature), generator)


@torch.no_grad()
def stream_rollouts(
    view: ModelView,
    prompt_ids: Sequence[Sequence[int]],
    instruction_lengths: Sequence[int],
    settings: RolloutSettings,
    *,
    slots: int,
    max_new_tokens: int,
    temperature: float | Sequence[float] = 1.0,
    seeds: Sequence[int] | None = None,
    device: torch.device | str = "cpu",
) -> Rollouts:
    """:func:`generate_rollouts` for many prompts through ``slots`` rows decoded at once (a
    :class:`RolloutStream`): when a row's rationale ends (EOS or the budget), its slot takes the next
    prompt, so every step feeds a full batch until the prompts run out. Each row's rollout is the
    one it gets decoded alone (sampling without ``seeds`` draws from torch's global generator in
    another order), returned in the order given, prompts left-padded to the longest.

    Prompts enter longest first: a later prompt then always fits the columns the cache already has.
    """
    rows = len(prompt_ids)
    temperatures = per_row(temperature if settings.do_sample else 0.0, rows)
    entries = [
        streamed_row(i, prompt_ids[i], instruction_lengths[i], max_new_tokens, temperatures[i],
                     None if seeds is None else seeds[i])
        for i in range(rows)
    ]
    with incremental_decoder(view) as decoder:
        stream = RolloutStream(decoder, settings, slots=slots, device=device)
        for entry in sorted(entries, key=lambda e: len(e.prompt_ids), reverse=True):
            stream.add(entry)
        while stream.busy:
            stream.step()
    return assemble_rollouts(entries, device)


def assemble_rollouts(entries: Sequence[StreamedRow], device: torch.device | str = "cpu") -> Rollouts:
    """Finished :class:`StreamedRow` s as :class:`Rollouts`, in the order given: prompts left-padded to
    the longest, rationales right-padded to the longest."""
    rows, width = len(entries), max(len(e.prompt_ids) for e in entries)
    generated = max(len(e.rationale_ids) for e in entries)
    hidden = entries[0].prompt_states.shape[-1]
    token_embeddings = torch.zeros((rows, width + generated, hidden), dtype=entries[0].prompt_states.dtype, device=device)
    rationale_ids = torch.full((rows, generated), -1, dtype=torch.long, device=device)
    for index, entry in enumerate(entries):
        token_embeddings[index, width - len(entry.prompt_ids) : width] = entry.prompt_states
        if entry.rationale_ids:
            token_embeddings[index, width : width + len(entry.rationale_ids)] = torch.stack(entry.rationale_states)
            rationale_ids[index, : len(entry.rationale_ids)] = torch.tensor(entry.rationale_ids, device=device)
    _, prompt_mask = left_pad([e.prompt_ids for e in entries], 0)
    prompt_mask = prompt_mask.to(device)
    spans = torch.tensor([e.instruction_length for e in entries], device=device)
    return Rollouts(
        attention_mask=torch.cat([prompt_mask, (rationale_ids >= 0).long()], 1),
        pooling_mask=torch.cat([prompt_pooling_mask(prompt_mask, spans), rationale_ids >= 0], 1),
        token_embeddings=token_embeddings,
        rationale_ids=rationale_ids,
        truncated=torch.tensor([e.truncated for e in entries], dtype=torch.bool, device=device),
        stop_ids=torch.tensor([e.stop_id for e in entries], dtype=torch.long, device=device),
    )
