"""One thread that drives a model for many concurrent callers: continuous batching across requests.

A server hands each request's texts to :meth:`Scheduler.submit` and waits on the future it gets. The
scheduler thread prepares them exactly as ``encode`` does (the encoder's ``preprocess``: template,
instruction, budget and seeds by prompt type, rationale-cache keys), answers texts the rationale
cache holds at once, and feeds the rest into one running :class:`~grace_st.runtime.generation.RolloutStream`:
rows of every request share the decoding slots, a row whose rationale ends hands its slot to the next
waiting text, and texts with a budget of 0 (every text of the shipped default) are
prefilled together in one prompt pass. A request is answered as soon as its own texts are done.

Requests are fed into the stream a slice at a time, a row from each request in turn: a request's texts
are tokenised a chunk at a time as the stream needs them, and fewer than ``max_slots`` rows of
``prompt_pass_tokens`` prompt tokens wait in the stream at once. So every step (its prompt pass and
admissions) is bounded whatever a request holds, a small request is not queued behind a large one's
rows, and a request whose client left is dropped within a step. Each row is pooled (Eq. 3) when it ends
and its states let go: what a queued text holds is its text, its prompt's token ids and its pooled vector.

Each finished row is pooled, averaged over its text's rationales and assembled by ``encode``'s own data path
(:mod:`grace_st.encoding`: the rationale cache's lookup and store, :func:`~grace_st.encoding.to_features`), then
passed through the model's modules after the encoder (``Normalize``), so a text's
embedding is the one ``model.encode`` gives it, bit for bit where the native step runs: every per-row
computation is batch-invariant (``tests/test_batch_invariance.py``).

Where a stream does not apply (GIRCSE's soft tokens, GRC's latents, a vLLM backend, no preallocated
cache) or would not be batch-invariant (int8 weights, whose layers pick their kernel by the rows of a
call), each request runs through ``model.encode`` in turn, still from this one thread: its embeddings are
``encode``'s for the request's texts, bit for bit, and a request whose client left is dropped between
``encode``'s batches.

Bounded: at most ``max_queued_texts`` texts and ``max_queued_chars`` characters wait or decode at once;
:meth:`submit` refuses more with :class:`QueueFull` (a server's 429). A cancelled future (a client gone)
has its rows dropped from the queue and the slots. :meth:`stop` finishes what was submitted, then ends
the thread.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from grace_st.encoding import EncodeBatch, Plan, TextResult, lookup, store, text_results, to_features
from grace_st.runtime.batch import masked_mean
from grace_st.runtime.cpu.quantization import quantization_scheme
from grace_st.runtime.decoding import continuous_batching, incremental_decoder
from grace_st.runtime.generation import RolloutStream, StreamedRow, streamed_row

logger = logging.getLogger(__name__)

# A request's texts are tokenised this many characters at a time at most (at least one text): about 0.05 s of
# a fast tokenizer's time, so the thread looks at cancellations and other requests between chunks.
TOKENISE_CHARS = 256 * 1024
# encode's states a text that the server does not answer with: let go after each batch, not held to the end
_PER_TOKEN_OUTPUTS = ("token_embeddings", "attention_mask")


class QueueFull(RuntimeError):
    """More texts than the scheduler holds at once: retry later."""


class ShuttingDown(RuntimeError):
    """The scheduler is stopping and takes no new work."""


class _Abandoned(Exception):
    """The job being encoded was cancelled (its client left): ``encode`` stops at its next batch."""


@dataclass
class Embedded:
    """A request's answer: an embedding a text (n, dim) float32, each text's rationale (its first) when
    asked, and the tokens counted: the prompts' (template and instruction included), and the rationale
    tokens written for them."""

    embeddings: np.ndarray
    rationales: list[str] | None
    prompt_tokens: int
    rationale_tokens: int


@dataclass
class _Job:
    id: int
    texts: list[str]
    prompt_type: str
    return_rationale: bool
    future: Future
    chars: int
    tokenised: int = 0  # texts tokenised so far (the first ones): their rows are fed, waiting in `unfed`, or done
    plan: Plan = field(default_factory=lambda: Plan(0, 1))  # the budget and rationales a text, as preprocess chose
    instruction_span: int = 0
    prompts: list[list[int]] = field(default_factory=list)  # each tokenised text's prompt ids, P(x)
    unfed: deque[StreamedRow] = field(default_factory=deque)  # rows tokenised, not yet in the stream
    fed: set = field(default_factory=set)  # keys of its rows in the stream
    means: dict[int, tuple] = field(default_factory=dict)  # row → (pooled mean, rationale, truncated) until its text's
    results: dict[int, TextResult] = field(default_factory=dict)  # text → its embedding, rationales, truncation
    cache_keys: dict[int, str] = field(default_factory=dict)  # text → rationale-cache key, for texts embedded here
    fresh: dict[int, str] = field(default_factory=dict)  # text → key, of the results to store in the rationale cache

    @property
    def done(self) -> bool:
        return self.tokenised == len(self.texts) and len(self.results) == len(self.texts)


class Scheduler:
    """The only thread that drives ``model`` (a SentenceTransformer whose first module is a
    :class:`~grace_st.encoder.GenerativeEncoder`).

    Args:
        model: the model served.
        max_slots: rows decoded at once at most (the stream's slots, and a prompt pass's rows).
        min_slots: slots allocated even for fewer waiting rows (1: a lone request decodes alone, on the
            single-row step; the slots grow as requests arrive).
        max_queued_texts: texts waiting or in flight at most; more are refused (:class:`QueueFull`).
        max_queued_chars: characters of those texts at most; more are refused (:class:`QueueFull`).
        prompt_pass_tokens: prompt tokens waiting in the stream at most (at least one row), so at most this
            many (plus one prompt) go into a step's prompt pass and as many into its admissions, as vLLM's
            ``max_num_batched_tokens`` bounds a step. Short prompts fill ``max_slots`` rows under it.
        on_step: called with the rows each decoding step fed, and with ``prompt_pass=True`` with the
            rows of each prompt pass for budget-0 texts (metrics).
    """

    def __init__(
        self,
        model,
        *,
        max_slots: int = 32,
        min_slots: int = 1,
        max_queued_texts: int = 1024,
        max_queued_chars: int = 8 * 1024 * 1024,
        prompt_pass_tokens: int = 2048,
        on_step: Callable[..., None] | None = None,
    ):
        self.model, self.encoder = model, model[0]
        self.max_slots, self.min_slots, self.max_queued_texts = max_slots, min(min_slots, max_slots), max_queued_texts
        self.max_queued_chars, self.prompt_pass_tokens = max_queued_chars, prompt_pass_tokens
        self.on_step = on_step
        self._lock = threading.Condition()
        self._incoming: list[_Job] = []
        self._jobs: dict[int, _Job] = {}
        self._queued_texts = self._queued_chars = 0
        self._ids = itertools.count()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._stream: RolloutStream | None = None
        self._encoding: _Job | None = None  # the job ``encode`` runs for (whole-request path)
        self._encoded_tokens = 0

    # -- callers' side -----------------------------------------------------------------------------

    @property
    def queued_texts(self) -> int:
        """Texts submitted and not yet answered."""
        return self._queued_texts

    @property
    def queued_chars(self) -> int:
        """Characters of the texts submitted and not yet answered."""
        return self._queued_chars

    @property
    def alive(self) -> bool:
        """The thread runs (False before :meth:`start` and after :meth:`stop`)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> Scheduler:
        self._thread = threading.Thread(target=self._run, name="grace-st-scheduler", daemon=True)
        self._thread.start()
        return self

    def submit(self, texts: list[str], prompt_type: str = "default", return_rationale: bool = False) -> Future:
        """A future for the embeddings of ``texts`` as ``prompt_type`` (:class:`Embedded`). Cancel it to
        drop the texts' remaining work."""
        if not texts:
            raise ValueError("no texts to embed")
        future: Future = Future()
        chars = sum(map(len, texts))
        with self._lock:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            if self._queued_texts + len(texts) > self.max_queued_texts:
                raise QueueFull(f"{self._queued_texts} texts are queued; the limit is {self.max_queued_texts}")
            if self._queued_chars + chars > self.max_queued_chars:
                raise QueueFull(
                    f"texts of {self._queued_chars} characters are queued; the limit is {self.max_queued_chars}"
                )
            self._queued_texts += len(texts)
            self._queued_chars += chars
            job = _Job(next(self._ids), list(texts), prompt_type, return_rationale, future, chars)
            self._incoming.append(job)
            self._lock.notify()
        return future

    def stop(self, timeout: float | None = None) -> None:
        """Take no new work, finish what was submitted, end the thread."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the thread --------------------------------------------------------------------------------

    def _streams(self) -> bool:
        engine = self.encoder.engine
        return (
            engine.ragged  # the engine's own word: its rows end at different steps (not GIRCSE's soft tokens)
            and engine.embeds_decoding_states  # the stream's pooled states are the embedding (not GRC's latents)
            and engine.generator is None
            and continuous_batching(self.encoder.model, self.encoder.decode_options)
            # int8 layers take a kernel for few rows and a matmul for many (quantization.KERNEL_MAX_ROWS): a row's
            # bits would depend on what else shares its step, where encode's depend on its batch
            and quantization_scheme(self.encoder.model) is None
        )

    def _run(self) -> None:
        torch.set_grad_enabled(False)  # a thread's own switch: this one only ever embeds
        streams = self._streams()
        with contextlib.ExitStack() as block:
            if not streams:
                block.enter_context(self._encode_hooks())
            while True:
                with self._lock:
                    while not self._incoming and not self._jobs and not self._stopping:
                        self._lock.wait()
                    if self._stopping and not self._incoming and not self._jobs:
                        return
                    incoming, self._incoming = self._incoming, []
                for job in incoming:
                    self._jobs[job.id] = job
                self._drop_cancelled()
                if not streams:
                    for job in list(self._jobs.values()):
                        self._run_whole(job)
                    continue
                if self._stream is None:
                    self._stream = self._open_stream(block)
                stream = self._stream
                self._feed(stream)
                if not stream.busy:  # what was fed was answered from the rationale cache, or nothing was
                    continue
                try:
                    ended = stream.step()
                except Exception as error:  # a failed step fails the rows in it, never the thread
                    logger.exception("a decoding step failed")
                    self._fail_all(error)
                    block.close()
                    self._stream = None
                    continue
                for row in ended:
                    self._row_done(row)
                if self.on_step is not None and stream.rows_stepped:
                    self.on_step(stream.rows_stepped)
                if self.on_step is not None and stream.rows_prefilled:
                    self.on_step(stream.rows_prefilled, prompt_pass=True)
                if not stream.busy and any(job.fed for job in self._jobs.values()):  # never: fed rows end in it
                    self._fail_all(RuntimeError("rows were lost from the decoding stream"))

    def _open_stream(self, block: contextlib.ExitStack) -> RolloutStream:
        encoder, engine = self.encoder, self.encoder.engine
        decoder = block.enter_context(incremental_decoder(engine.view))
        settings = engine.rollout_settings(encoder.do_sample, encoder.top_p, encoder.repetition_penalty)
        return RolloutStream(
            decoder,
            settings,
            slots=lambda waiting: min(self.max_slots, max(self.min_slots, waiting)),
            device=next(encoder.model.parameters()).device,
        )

    def _call(self, prompt_type: str) -> tuple[str | None, str | None]:
        """The prompt and task ``encode_query`` / ``encode_document`` / ``encode(prompt_name=...)`` would pass."""
        prompt = self.model.prompts.get(prompt_type) or None
        return prompt, (prompt_type if prompt_type in ("query", "document") else None)

    def _feed(self, stream: RolloutStream) -> None:
        """Rows into the stream, one from each job in turn, while fewer than ``max_slots`` rows and
        ``prompt_pass_tokens`` prompt tokens of their kind wait there (budget-0 rows for the prompt pass,
        the others for decoding slots); a job's texts are tokenised as its rows are wanted."""
        rows, tokens = [0, 0], [0, 0]
        for row in stream.waiting:
            kind = row.max_new_tokens > 0
            rows[kind] += 1
            tokens[kind] += len(row.prompt_ids)
        fed = True
        while fed:
            fed = False
            for job in list(self._jobs.values()):
                if job.future.cancelled():
                    continue  # dropped at the next turn of the loop
                if not job.unfed and job.tokenised < len(job.texts):
                    self._tokenise(job)  # a chunk at most waits tokenised a job: what the stream takes next
                if not job.unfed:
                    continue
                row = job.unfed[0]
                kind = row.max_new_tokens > 0
                if rows[kind] >= self.max_slots or tokens[kind] >= self.prompt_pass_tokens:
                    continue
                job.unfed.popleft()
                stream.add(row)
                job.fed.add(row.key)
                rows[kind] += 1
                tokens[kind] += len(row.prompt_ids)
                fed = True

    def _tokenise(self, job: _Job) -> None:
        """The job's next texts (up to ``TOKENISE_CHARS`` characters, ``max_slots`` texts) prepared as ``encode``
        prepares them: texts the rationale cache holds answered, rows for the others to feed. A failure fails
        the job, never the thread."""
        end, chars = job.tokenised, 0
        while end < len(job.texts) and end - job.tokenised < self.max_slots:
            chars += len(job.texts[end])
            if end > job.tokenised and chars > TOKENISE_CHARS:
                break
            end += 1
        try:
            prompt, task = self._call(job.prompt_type)
            batch = EncodeBatch.from_features(
                self.encoder.preprocess(job.texts[job.tokenised : end], prompt=prompt, task=task)
            )
            request = batch.request(self.encoder.sampling())
            job.plan, job.instruction_span = batch.plan, batch.instruction_span
            repeats = batch.plan.repeats
            found = lookup(self.encoder.rationale_cache, batch) if batch.cache_keys is not None else {}
            for local, index in enumerate(range(job.tokenised, end)):
                job.prompts.append(request.prompt_ids[local * repeats])
                if local in found:
                    job.results[index] = found[local]
                    continue
                if batch.cache_keys is not None:
                    job.cache_keys[index] = batch.cache_keys[local]
                for k in range(repeats):
                    row = local * repeats + k
                    seed = None if request.seeds is None else request.seeds[row]
                    job.unfed.append(
                        streamed_row(
                            (job.id, index * repeats + k),
                            request.prompt_ids[row],
                            request.instruction_lengths[row],
                            batch.plan.budget,
                            request.temperatures[row],
                            seed,
                        )
                    )
            job.tokenised = end
        except Exception as error:  # noqa: BLE001 (this job fails, never the thread)
            self._finish(job, error=error)
            return
        if job.done:
            self._complete(job)

    def _row_done(self, row: StreamedRow) -> None:
        """A row's pooled mean (Eq. 3), taken now so that its states go; its text's entry once every rollout
        of the text is in (the mean over them), the job's answer once every text's is."""
        job = self._jobs.get(row.key[0])
        if job is None:
            return
        job.fed.discard(row.key)
        mean = masked_mean(row.token_embeddings()[None], row.pooling_mask()[None])
        job.means[row.key[1]] = (mean, row.rationale_ids, row.truncated)
        repeats = job.plan.repeats
        index = row.key[1] // repeats
        rollouts = [job.means.get(index * repeats + k) for k in range(repeats)]
        if any(rollout is None for rollout in rollouts):
            return
        for k in range(repeats):
            del job.means[index * repeats + k]
        pooled, rationale_ids, truncated = zip(*rollouts)
        result = text_results(torch.cat(pooled), rationale_ids, truncated, repeats)[0]
        # the vector waits on the CPU as the rationale cache holds it: nothing of the rows stays on the device
        job.results[index] = TextResult.from_entry(result.entry())
        if index in job.cache_keys:
            job.fresh[index] = job.cache_keys.pop(index)
        if job.done:
            self._complete(job)

    def _complete(self, job: _Job) -> None:
        """The job's embeddings from its texts' results, assembled as ``forward`` assembles them, through the
        model's later modules; fresh results stored in the rationale cache."""
        try:
            encoder = self.encoder
            if job.fresh:
                store(encoder.rationale_cache, list(job.fresh.values()), [job.results[i] for i in job.fresh])
            batch = EncodeBatch.build(job.prompts, job.instruction_span, job.plan, encoder.pad_token_id)
            out = to_features(batch, [job.results[index] for index in range(len(job.texts))])
            for module in list(self.model)[1:]:
                out = module(out)
            ids = out["rationale_token_ids"][:, 0]
            result = Embedded(
                embeddings=out["sentence_embedding"].detach().float().cpu().numpy(),
                rationales=self.encoder.decode_rationales(ids) if job.return_rationale else None,
                prompt_tokens=sum(map(len, job.prompts)),
                rationale_tokens=int((ids >= 0).sum()),
            )
        except Exception as error:  # noqa: BLE001 (this job fails, never the thread)
            self._finish(job, error=error)
            return
        self._finish(job, result)

    # -- requests a stream does not serve -----------------------------------------------------------

    @contextlib.contextmanager
    def _encode_hooks(self):
        """While ``encode`` runs a job on this thread: stop it at its next batch when the job is cancelled, count
        the prompt tokens it reads, and let go of the per-token states the answer does not use."""

        def before(_module, args, kwargs):
            if self._encoding is not None and threading.current_thread() is self._thread:
                if self._encoding.future.cancelled():
                    raise _Abandoned
                features = args[0] if args else kwargs["features"]
                self._encoded_tokens += EncodeBatch.from_features(features).prompt_tokens()

        def after(_module, _args, output):
            if self._encoding is None or threading.current_thread() is not self._thread:
                return None
            return {name: value for name, value in output.items() if name not in _PER_TOKEN_OUTPUTS}

        handles = [
            self.encoder.register_forward_pre_hook(before, with_kwargs=True),
            self.encoder.register_forward_hook(after),
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _run_whole(self, job: _Job) -> None:
        """The job through ``model.encode``, as a caller in process would run its texts, so the answer is
        ``encode``'s bit for bit; dropped between ``encode``'s batches once cancelled."""
        prompt, task = self._call(job.prompt_type)
        self._encoding, self._encoded_tokens = job, 0
        try:
            items = self.model.encode(
                job.texts, prompt=prompt, task=task, output_value=None, convert_to_numpy=False, show_progress_bar=False
            )
            ids = [item["rationale_token_ids"][0] for item in items]
            result = Embedded(
                embeddings=torch.stack([item["sentence_embedding"] for item in items]).float().cpu().numpy(),
                rationales=[self.encoder.decode_rationales(i[None])[0] for i in ids] if job.return_rationale else None,
                prompt_tokens=self._encoded_tokens,
                rationale_tokens=sum(int((i >= 0).sum()) for i in ids),
            )
        except _Abandoned:
            self._release(job)
            return
        except Exception as error:  # noqa: BLE001 (this job fails, never the thread)
            self._finish(job, error=error)
            return
        finally:
            self._encoding = None
        self._finish(job, result)

    # -- the books ----------------------------------------------------------------------------------

    def _release(self, job: _Job) -> None:
        """The job out of the books and the queue's counts; its rows out of the stream."""
        self._jobs.pop(job.id, None)
        with self._lock:
            self._queued_texts -= len(job.texts)
            self._queued_chars -= job.chars
        if self._stream is not None and job.fed:
            self._stream.drop(job.fed)
        job.fed, job.unfed, job.means = set(), deque(), {}

    def _finish(self, job: _Job, result: Embedded | None = None, error: BaseException | None = None) -> None:
        self._release(job)
        if job.future.cancelled():
            return
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    def _drop_cancelled(self) -> None:
        """Jobs whose future was cancelled (their client left): out of the stream and the books."""
        for job in [job for job in self._jobs.values() if job.future.cancelled()]:
            self._release(job)

    def _fail_all(self, error: BaseException) -> None:
        for job in list(self._jobs.values()):
            self._finish(job, error=error)
