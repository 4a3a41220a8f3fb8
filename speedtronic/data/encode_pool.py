"""Tokenizing in worker processes for ``speedtronic prepare``, with every failure reported.

A ``tokenizer.json`` is run by the ``tokenizers`` library, native code that can panic (a
pre-tokenizer regex that gives up), crash or take unbounded time on some text, and a
``Ctrl-C`` cannot interrupt it. So ``prepare`` never runs it in its own process: ``workers``
processes do (one included), each with its own task and result queue. Batch ``i`` goes to
worker ``i % workers``, which handles its batches in order, so the results are read back
in submission order. The parent watches while it waits:

* a worker that dies (killed, crashed, out of memory) is an error (``_WorkerDied``) naming
  it, its pid and how it ended -- never a wait for a result that cannot come;
* a tokenizer failure in a worker comes back as a message; the worker then encodes the
  batch's documents one by one to name the one that fails (``TokenizerFailure``);
* a batch not done ``timeout`` seconds after it became the next one due (when it was
  submitted, or when the batch before it came back, whichever is later) is an error
  (``_TokenizeTimeout``) naming its documents.

On any error the workers are killed before the error propagates; on success each gets an
end-of-work marker and exits.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import signal
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.context import ForkContext, SpawnContext
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from types import TracebackType

import numpy as np
import numpy.typing as npt

from speedtronic.data.shards import DTYPES
from speedtronic.data.text import DataSourceError
from speedtronic.data.tokenizer import (
    BYTES,
    ByteCorpusTokenizer,
    CorpusTokenizer,
    FileTokenizer,
    TokenizerFailure,
)

__all__ = ["EncodePool", "EncodeTask"]

_POLL_SECONDS = 0.1
_STOP_SECONDS = 10.0

_Ids = npt.NDArray[np.unsignedinteger]
_Reply = tuple[str, object, str]  # ("ids", array, "") | ("failed", index, reason) | ("error", ...)


class _WorkerDied(RuntimeError):
    """A tokenizing worker process ended while it had work (exit 1, not the user's input)."""


class _TokenizeTimeout(DataSourceError):
    """A batch the tokenizer did not finish within the time bound."""


@dataclass(frozen=True)
class EncodeTask:
    """One batch: the texts, which of them end a document, the end-of-document id, dtype."""

    texts: list[str]
    ends: list[bool]
    eos_id: int
    dtype: str


def _spec_of(tokenizer: CorpusTokenizer) -> tuple[str, bytes]:
    """What a worker needs to build the same tokenizer: its name and file bytes."""
    if isinstance(tokenizer, FileTokenizer):
        return tokenizer.name, tokenizer.data
    return BYTES, b""


def _build(spec: tuple[str, bytes]) -> CorpusTokenizer:
    name, data = spec
    return ByteCorpusTokenizer() if name == BYTES else FileTokenizer(name, data)


def _culprit(tokenizer: CorpusTokenizer, task: EncodeTask) -> int:
    """The first text of a failed batch that fails alone (0 when none does)."""
    for index, text in enumerate(task.texts):
        try:
            tokenizer.encode(text)
        except TokenizerFailure:
            return index
    return 0


def _encode(tokenizer: CorpusTokenizer, task: EncodeTask) -> _Reply:
    try:
        ids = tokenizer.encode_documents(task.texts, task.ends, task.eos_id, DTYPES[task.dtype])
    except TokenizerFailure as exc:
        return ("failed", _culprit(tokenizer, task), exc.reason)
    except Exception as exc:  # reported by the parent, with the batch's documents
        return ("error", 0, f"{type(exc).__name__}: {exc}")
    return ("ids", ids, "")


def _worker_main(
    spec: tuple[str, bytes], tasks: Queue[EncodeTask | None], results: Queue[_Reply]
) -> None:
    # Ctrl-C reaches the whole process group: the parent handles it and stops the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # ``workers`` is the parallelism
    tokenizer = _build(spec)
    while (task := tasks.get()) is not None:
        results.put(_encode(tokenizer, task))


def _start_method() -> str:
    # fork starts a worker in milliseconds (no re-import of torch); elsewhere it is unsafe.
    return "fork" if sys.platform.startswith("linux") else "spawn"


def _how_it_ended(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exited with code {code}"


def _documents(wheres: Sequence[str]) -> str:
    if not wheres:
        return "a batch without text"
    if len(wheres) == 1:
        return wheres[0]
    return f"one of {len(wheres)} documents from {wheres[0]} to {wheres[-1]}"


class EncodePool:
    """``workers`` tokenizing processes (module docstring); a context manager that kills
    them on an error and stops them cleanly otherwise."""

    def __init__(self, tokenizer: CorpusTokenizer, workers: int, timeout: float) -> None:
        self.name = tokenizer.name
        self.timeout = timeout
        context = multiprocessing.get_context(_start_method())
        assert isinstance(context, (ForkContext, SpawnContext))
        self._tasks: list[Queue[EncodeTask | None]] = [context.Queue() for _ in range(workers)]
        self._results: list[Queue[_Reply]] = [context.Queue() for _ in range(workers)]
        self._processes: list[BaseProcess] = []
        self._submitted: deque[float] = deque()  # submission times of the batches not read
        self._sent = self._read = 0
        self._last_done = time.monotonic()
        spec = _spec_of(tokenizer)
        for tasks, results in zip(self._tasks, self._results, strict=True):
            process = context.Process(target=_worker_main, args=(spec, tasks, results), daemon=True)
            process.start()
            self._processes.append(process)

    def __enter__(self) -> EncodePool:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if kind is None:
            self._stop()
        else:
            self._kill()

    def submit(self, task: EncodeTask) -> None:
        self._tasks[self._sent % len(self._tasks)].put(task)
        self._sent += 1
        self._submitted.append(time.monotonic())

    def result(self, wheres: Sequence[str]) -> _Ids:
        """The ids of the oldest batch not read yet (``wheres``: its documents, for errors)."""
        index = self._read % len(self._results)
        deadline = max(self._submitted.popleft(), self._last_done) + self.timeout
        while True:
            self._check_alive()
            left = deadline - time.monotonic()
            if left <= 0:
                raise _TokenizeTimeout(
                    f"{self.name}: the tokenizer did not finish within {self.timeout:g} s "
                    f"(--tokenize-timeout) on {_documents(wheres)}: a pre-tokenizer regex "
                    "that backtracks, or a very long document?"
                )
            try:
                kind, value, reason = self._results[index].get(timeout=min(_POLL_SECONDS, left))
            except queue.Empty:
                continue
            break
        self._read += 1
        self._last_done = time.monotonic()
        if kind == "ids":
            assert isinstance(value, np.ndarray)
            return value
        inside = isinstance(value, int) and 0 <= value < len(wheres)
        where = wheres[value] if isinstance(value, int) and inside else _documents(wheres)
        if kind == "failed":
            raise TokenizerFailure(
                f"{self.name}: the tokenizer failed on {where} ({reason})", reason
            )
        raise DataSourceError(f"{self.name}: tokenizing {_documents(wheres)} failed: {reason}")

    def _check_alive(self) -> None:
        for number, process in enumerate(self._processes, start=1):
            code = process.exitcode
            if code is not None and (code != 0 or self._sent > self._read):
                raise _WorkerDied(
                    f"tokenizing worker {number} of {len(self._processes)} (pid {process.pid}) "
                    f"{_how_it_ended(code)}; nothing was written"
                )

    def _stop(self) -> None:
        try:
            self._check_alive()  # a worker that died idle is an error all the same
            for tasks in self._tasks:
                tasks.put(None)
            deadline = time.monotonic() + _STOP_SECONDS
            for process in self._processes:
                process.join(max(0.0, deadline - time.monotonic()))
            if any(process.exitcode for process in self._processes):
                self._check_alive()  # one killed just now: names it
        finally:
            self._kill()

    def _kill(self) -> None:
        for process in self._processes:
            if process.exitcode is None:
                process.kill()
        for process in self._processes:
            process.join()
        for tasks in self._tasks:
            tasks.cancel_join_thread()  # a dead reader: never wait to flush to it
            tasks.close()
        for results in self._results:
            results.close()
