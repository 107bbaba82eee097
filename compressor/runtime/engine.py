"""The serving engine behind ``kvq serve``: a :class:`~compressor.runtime.Runtime` plus its
tokenizer, fed from a bounded queue by any thread, generating one batch at a time.

A worker thread takes what is waiting and groups up to ``max_batch`` greedy sequences into
one :meth:`~compressor.runtime.Runtime.generate` call (a sampled sequence runs alone, so its
``seed`` reproduces its text whatever else arrives). At most ``max_queue`` sequences wait
(:class:`QueueFull` beyond). Cancelling a sequence's future drops it: out of the queue at
once, or at the next decode step of the running batch.
"""

from __future__ import annotations

import secrets
import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Sequence

from ..errors import InputError
from ..tokens import bos_rule, encode

MAX_QUEUE = 64  # sequences waiting for the engine (default of ``kvq serve --max-queue``)


#: said at ``kvq serve``'s start-up and in serve-smoke's report when the tokenizer has no chat template
CHAT_FALLBACK_NOTE = ("the artifact's tokenizer has no chat template: chat requests fall back to plain "
                      "'role: content' lines ending in 'assistant:', a prompt format the model was not trained on; "
                      "/v1/completions with the model's own prompt format is unaffected")


class QueueFull(Exception):
    """The engine's queue cannot take the sequences of a request (the server answers 429)."""


@dataclass(eq=False)
class _Request:
    """One sequence to generate; ``future`` resolves to ``(tokens, GenerationResult)``.
    Cancelling ``future`` drops the sequence (from the queue, or at the next decode step)."""

    ids: list[int]
    max_tokens: int
    greedy: bool
    temperature: float
    seed: int
    future: Future = field(default_factory=Future)


def _deliver(fut: Future, result: Any = None, exc: BaseException | None = None) -> None:
    """Resolve ``fut`` unless it is already done (a dropped request's future is cancelled)."""
    try:
        if fut.done():
            return
        if exc is None:
            fut.set_result(result)
        else:
            fut.set_exception(exc)
    except InvalidStateError:  # cancelled between the check and the call
        pass


class Engine:
    """A :class:`~compressor.runtime.Runtime` plus its tokenizer, serving one batch at a time.

    ``submit``/``submit_many`` may be called from any thread; a worker thread batches what
    is waiting. ``waiting`` (queued sequences), ``running`` (the batch being generated),
    ``batches`` (sizes of the batches run) and ``dropped`` (sequences cancelled by their
    client) describe its state.

    Args:
        runtime: the loaded model (:meth:`~compressor.runtime.Runtime.from_artifact`).
        tokenizer: its transformers tokenizer.
        name: the model name requests may give in ``model``.
        max_batch: greedy sequences generated together.
        max_queue: sequences allowed to wait; more raise :class:`QueueFull`.
    """

    def __init__(self, runtime, tokenizer, name: str, max_batch: int = 8, max_queue: int = MAX_QUEUE):
        if max_batch < 1 or max_queue < 1:
            raise InputError(f"max_batch and max_queue must be >= 1, got {max_batch} and {max_queue}")
        self.runtime, self.tokenizer, self.name = runtime, tokenizer, name
        self.max_batch, self.max_queue = max_batch, max_queue
        self.eos = tokenizer.eos_token_id
        self.bos_rule = bos_rule(tokenizer)  # prompts start with the BOS the tokenizer adds, if it adds one
        self.chat_template = bool(getattr(tokenizer, "chat_template", None))
        self.waiting: list[_Request] = []
        self.running: list[_Request] = []
        self.batches: list[int] = []
        self.dropped = 0
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="kvq-engine", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the worker after the batch it is running; waiting requests fail."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` by the tokenizer's own rule (:func:`compressor.tokens.encode`):
        its BOS first when it adds one, then the text's tokens; the BOS id alone for an empty text.

        Raises:
            InputError: the text is empty after tokenization and the tokenizer has no BOS.
        """
        return encode(self.tokenizer, text, self.bos_rule["bos_token_id"])

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` through the chat template (whose text carries its own BOS,
        as the template writes it), or, for a tokenizer without one (:attr:`chat_template`
        false; GGUF conversions often have none), ``role: content`` lines then ``assistant:``
        encoded by :meth:`encode` (the BOS by the tokenizer's rule). :data:`CHAT_FALLBACK_NOTE`
        is what ``kvq serve`` and serve-smoke say of the fallback."""
        if self.chat_template:
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
            return list(ids)
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return self.encode(text)

    def submit(self, ids: list[int], max_tokens: int, temperature: float = 0.0, seed: int | None = None) -> Future:
        """Queue one generation (see :meth:`submit_many`)."""
        return self.submit_many([ids], max_tokens, temperature, seed)[0]

    def submit_many(self, prompts: Sequence[Sequence[int]], max_tokens: int, temperature: float = 0.0,
                    seed: int | None = None) -> list[Future]:
        """Queue one generation per prompt, all or none; greedy (``temperature`` 0) sequences
        are batched together, sampled ones run alone so a ``seed`` reproduces its text
        whatever else arrives (no seed: a fresh random one per sequence).

        Returns:
            one future per prompt, resolving to ``(generated ids, GenerationResult)``;
            cancel it to drop the sequence.

        Raises:
            QueueFull: fewer than ``len(prompts)`` places left in the queue.
            RuntimeError: the engine is closed.
        """
        reqs = [_Request(list(ids), int(max_tokens), temperature == 0.0, float(temperature) or 1.0,
                         int(secrets.randbits(31) if seed is None else seed)) for ids in prompts]
        with self._cv:
            if self._closed:
                raise RuntimeError("server shutting down")
            if len(self.waiting) + len(reqs) > self.max_queue:
                raise QueueFull(f"the server's queue is full ({len(self.waiting)} sequences waiting, limit "
                                f"{self.max_queue}; this request has {len(reqs)}); retry later")
            self.waiting.extend(reqs)
            self._cv.notify_all()
        for r in reqs:
            r.future.add_done_callback(partial(self._forget, r))
        return [r.future for r in reqs]

    def _forget(self, req: _Request, fut: Future) -> None:
        if fut.cancelled():
            with self._cv:
                self.dropped += 1
                if req in self.waiting:
                    self.waiting.remove(req)

    def check_length(self, ids: list[int], max_tokens: int, what: str = "max_tokens") -> None:
        """Raise InputError when prompt + ``max_tokens`` exceed the model's context length; ``what``
        names the caller's option for the tokens to generate (the request field, or a flag)."""
        limit = self.runtime.decoder.spec.max_position_embeddings
        if len(ids) + max_tokens > limit:
            raise InputError(f"prompt of {len(ids)} tokens + {what} {max_tokens} exceeds the model's context "
                             f"length {limit}")
        self.runtime.check_length(len(ids) + max_tokens)

    def _take_batch(self) -> list[_Request]:
        """The next batch (lock held): up to ``max_batch`` greedy sequences, or the first sampled one alone."""
        first = self.waiting[0]
        batch = [r for r in self.waiting if r.greedy][: self.max_batch] if first.greedy else [first]
        taken = set(map(id, batch))
        self.waiting = [r for r in self.waiting if id(r) not in taken]
        return batch

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self.waiting and not self._closed:
                    self._cv.wait()
                if self._closed:
                    leftover, self.waiting = self.waiting, []
                    break
                batch = self.running = self._take_batch()
            try:
                res, exc = self._generate(batch), None
            except BaseException as e:  # noqa: BLE001 - delivered to the waiting requests
                res, exc = None, e
            with self._cv:  # no longer running once answered
                self.running = []
            for i, r in enumerate(batch):
                if exc is None:
                    _deliver(r.future, (res.tokens[i][: r.max_tokens], res))
                else:
                    _deliver(r.future, exc=exc)
        for r in leftover:
            _deliver(r.future, exc=RuntimeError("server shutting down"))

    def _generate(self, batch: list[_Request]):
        first = batch[0]
        res = self.runtime.generate([r.ids for r in batch], max_new_tokens=max(r.max_tokens for r in batch),
                                    greedy=first.greedy, temperature=first.temperature, seed=first.seed,
                                    eos_token_id=self.eos, cancelled=lambda: [r.future.cancelled() for r in batch])
        self.batches.append(len(batch))
        return res

    def used_tokens(self, toks: list[int], text: str, stop: list[str]) -> int:
        """Completion tokens to bill: all generated ones, or, when a stop string cut the
        text, the tokens of the text returned."""
        if stop and any(s in self.tokenizer.decode(toks, skip_special_tokens=True) for s in stop):
            return len(self.tokenizer(text, add_special_tokens=False).input_ids)
        return len(toks)

    def finish(self, ids: list[int], toks: list[int], max_tokens: int, stop: list[str]) -> tuple[str, str]:
        """Decoded text and OpenAI ``finish_reason`` (``stop`` or ``length``)."""
        reason = "length"
        if self.eos is not None and toks and toks[-1] == self.eos:
            toks, reason = toks[:-1], "stop"
        text = self.tokenizer.decode(toks, skip_special_tokens=True)
        for s in stop:
            cut = text.find(s)
            if cut >= 0:
                text, reason = text[:cut], "stop"
        return text, reason
