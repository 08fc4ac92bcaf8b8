"""One thread that drives a model for many concurrent callers: continuous batching across requests.

A server hands each request's texts to :meth:`Scheduler.submit` and waits on the future it gets. The
scheduler thread prepares them exactly as ``encode`` does (the encoder's ``preprocess``: template,
instruction, budget and seeds by prompt type, rationale-cache keys), answers texts the rationale
cache holds at once, and feeds the rest into one running :class:`~grace_st.generation.RolloutStream`:
rows of every request share the decoding slots, a row whose rationale ends hands its slot to the next
waiting text, and texts with a budget of 0 (documents, or the shipped default's queries) are
prefilled together in one prompt pass. A request is answered as soon as its own texts are done.

Each finished row is pooled (Eq. 3), averaged over its text's rationales and passed through the
model's modules after the encoder (``Normalize``) by the encoder's own output builder, so a text's
embedding is the one ``model.encode`` gives it, bit for bit where the native step runs: every per-row
computation is batch-invariant (``tests/test_batch_invariance.py``).

Where a stream does not apply (GIRCSE's soft tokens, a vLLM backend, no preallocated cache), each
request runs as one ``model.forward`` batch in turn, still from this one thread.

Bounded: at most ``max_queued_texts`` texts wait or decode at once; :meth:`submit` refuses more with
:class:`QueueFull` (a server's 429). A cancelled future (a client gone) has its rows dropped from the
queue and the slots. :meth:`stop` finishes what was submitted, then ends the thread.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from .batch import masked_mean, pad_rationales
from .cache import CacheEntry
from .decoding import continuous_batching, incremental_decoder
from .generation import RolloutStream, StreamedRow, streamed_row

logger = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """More texts than the scheduler holds at once: retry later."""


class ShuttingDown(RuntimeError):
    """The scheduler is stopping and takes no new work."""


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
    features: dict | None = None
    rows: dict[int, StreamedRow] = field(default_factory=dict)  # by row index, once finished
    cached: dict[int, CacheEntry] = field(default_factory=dict)  # by text index, from the rationale cache
    row_keys: set = field(default_factory=set)  # its rows' keys in the stream


class Scheduler:
    """The only thread that drives ``model`` (a SentenceTransformer whose first module is a
    :class:`~grace_st.encoder.GenerativeEncoder`).

    Args:
        model: the model served.
        max_slots: rows decoded at once at most (the stream's slots, and a prompt pass's rows).
        min_slots: slots allocated even for fewer waiting rows (1: a lone request decodes alone, on the
            single-row step; the slots grow as requests arrive).
        max_queued_texts: texts waiting or in flight at most; more are refused (:class:`QueueFull`).
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
        on_step: Callable[..., None] | None = None,
    ):
        self.model, self.encoder = model, model[0]
        self.max_slots, self.min_slots, self.max_queued_texts = max_slots, min(min_slots, max_slots), max_queued_texts
        self.on_step = on_step
        self._lock = threading.Condition()
        self._incoming: list[_Job] = []
        self._jobs: dict[int, _Job] = {}
        self._queued_texts = 0
        self._ids = itertools.count()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._stream: RolloutStream | None = None

    # -- callers' side -----------------------------------------------------------------------------

    @property
    def queued_texts(self) -> int:
        """Texts submitted and not yet answered."""
        return self._queued_texts

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
        future: Future = Future()
        with self._lock:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            if self._queued_texts + len(texts) > self.max_queued_texts:
                raise QueueFull(f"{self._queued_texts} texts are queued; the limit is {self.max_queued_texts}")
            self._queued_texts += len(texts)
            job = _Job(next(self._ids), list(texts), prompt_type, return_rationale, future)
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
        )

    def _run(self) -> None:
        torch.set_grad_enabled(False)  # a thread's own switch: this one only ever embeds
        streams = self._streams()
        with contextlib.ExitStack() as block:
            while True:
                with self._lock:
                    while not self._incoming and not self._jobs and not self._stopping:
                        self._lock.wait()
                    if self._stopping and not self._incoming and not self._jobs:
                        return
                    incoming, self._incoming = self._incoming, []
                self._drop_cancelled()
                for job in incoming:
                    self._jobs[job.id] = job
                if not streams:
                    for job in incoming:
                        self._run_whole(job)
                    continue
                if self._stream is None:
                    self._stream = self._open_stream(block)
                stream = self._stream
                for job in incoming:
                    self._prepare(job, stream)
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
                if self._jobs and not stream.busy:  # never: every job's rows end in the stream
                    self._fail_all(RuntimeError("rows were lost from the decoding stream"))

    def _open_stream(self, block: contextlib.ExitStack) -> RolloutStream:
        encoder, engine = self.encoder, self.encoder.engine
        decoder = block.enter_context(incremental_decoder(encoder.model, encoder.hidden_layer, encoder.decode_options))
        settings = engine.rollout_settings(encoder.do_sample, encoder.top_p, encoder.repetition_penalty)
        return RolloutStream(
            decoder,
            settings,
            slots=lambda waiting: min(self.max_slots, max(self.min_slots, waiting)),
            device=next(encoder.model.parameters()).device,
        )

    def _features(self, job: _Job) -> dict:
        """``encode``'s features for the job's texts: the prompt and task ``encode_query`` /
        ``encode_document`` / ``encode(prompt_name=...)`` would pass."""
        prompt = self.model.prompts.get(job.prompt_type) or None
        task = job.prompt_type if job.prompt_type in ("query", "document") else None
        return self.encoder.preprocess(job.texts, prompt=prompt, task=task)

    def _prepare(self, job: _Job, stream: RolloutStream) -> None:
        """The job's rows into the stream, less the texts the rationale cache answers."""
        try:
            job.features = features = self._features(job)
            request = self.encoder.rollout_request(features)
            repeats = self.encoder.batch_plan(features)[1]
            missing = range(len(job.texts))
            if "cache_keys" in features:
                found = self.encoder.rationale_cache.lookup(features["cache_keys"])
                for index, key in enumerate(features["cache_keys"]):
                    if key in found:
                        job.cached[index] = found[key]
                missing = [i for i in missing if i not in job.cached]
            rows = [i * repeats + k for i in missing for k in range(repeats)]
            job.row_keys = {(job.id, row) for row in rows}
            for row in rows:
                seed = None if request.seeds is None else request.seeds[row]
                stream.add(
                    streamed_row(
                        (job.id, row),
                        request.prompt_ids[row],
                        request.instruction_lengths[row],
                        request.max_new_tokens,
                        request.temperatures[row],
                        seed,
                    )
                )
        except Exception as error:  # noqa: BLE001 (this job fails, never the thread)
            self._finish(job, error=error)
            return
        if not rows:
            self._complete(job)

    def _row_done(self, row: StreamedRow) -> None:
        job = self._jobs.get(row.key[0])
        if job is None:
            return
        job.rows[row.key[1]] = row
        if len(job.rows) == len(job.row_keys):
            self._complete(job)

    def _complete(self, job: _Job) -> None:
        """The job's embeddings from its rows and cache entries, through the model's modules."""
        try:
            features, encoder = job.features, self.encoder
            repeats = encoder.batch_plan(features)[1]
            pooled, rationales, truncated = [], [], []
            fresh = {}
            for index in range(len(job.texts)):
                entry = job.cached.get(index)
                if entry is None:
                    rows = [job.rows[index * repeats + k] for k in range(repeats)]
                    means = torch.cat([masked_mean(r.token_embeddings()[None], r.pooling_mask()[None]) for r in rows])
                    entry = CacheEntry(
                        rationale_ids=[r.rationale_ids for r in rows],
                        truncated=[r.truncated for r in rows],
                        embedding=means.view(1, repeats, -1).mean(1)[0].float().cpu().numpy(),
                    )
                    if "cache_keys" in features:
                        fresh[features["cache_keys"][index]] = entry
                pooled.append(torch.from_numpy(entry.embedding))
                rationales.append(entry.rationale_ids)
                truncated.append(entry.truncated)
            if fresh:
                encoder.rationale_cache.store(fresh)
            out = encoder.outputs(
                features, torch.stack(pooled), pad_rationales(rationales, repeats), torch.tensor(truncated)
            )
            self._finish(job, out=self._after_encoder(out))
        except Exception as error:  # noqa: BLE001 (this job fails, never the thread)
            self._finish(job, error=error)

    def _after_encoder(self, out: dict) -> dict:
        for module in list(self.model)[1:]:
            out = module(out)
        return out

    def _run_whole(self, job: _Job) -> None:
        """A model whose thinking does not stream: the job as one ``forward`` batch (``encode``'s)."""
        try:
            job.features = self._features(job)
            out = self.model(dict(job.features))
            self._finish(job, out=out)
        except Exception as error:  # noqa: BLE001 (this job fails, never the thread)
            self._finish(job, error=error)

    def _finish(self, job: _Job, out: dict | None = None, error: BaseException | None = None) -> None:
        self._jobs.pop(job.id, None)
        with self._lock:
            self._queued_texts -= len(job.texts)
        if job.future.cancelled():
            return
        if error is not None:
            job.future.set_exception(error)
            return
        ids = out["rationale_token_ids"]
        rationales = self.encoder.decode_rationales(ids[:, 0]) if job.return_rationale else None
        job.future.set_result(
            Embedded(
                embeddings=out["sentence_embedding"].detach().float().cpu().numpy(),
                rationales=rationales,
                prompt_tokens=int(job.features["attention_mask"].sum())
                // max(1, self.encoder.batch_plan(job.features)[1]),
                rationale_tokens=int((ids[:, 0] >= 0).sum()),
            )
        )

    def _drop_cancelled(self) -> None:
        """Jobs whose future was cancelled (their client left): out of the stream and the books."""
        gone = [job for job in self._jobs.values() if job.future.cancelled()]
        for job in gone:
            self._jobs.pop(job.id, None)
            with self._lock:
                self._queued_texts -= len(job.texts)
            if self._stream is not None:
                self._stream.drop(job.row_keys)

    def _fail_all(self, error: BaseException) -> None:
        for job in list(self._jobs.values()):
            self._finish(job, error=error)
