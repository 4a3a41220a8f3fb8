"""Real child processes that start in milliseconds: forked from a preloaded fork server.

A fresh interpreter pays ~3 s of ``import torch`` (and ~2 s more for ``torch._dynamo``, which
the first optimizer step imports) before it runs anything; on a 2-core machine a test that
starts four ranks pays that four times over. Here every child is forked from one
``multiprocessing`` fork server per test process that imported torch, speedtronic and the
built-in callbacks once (``PRELOAD``), so a child starts in a few milliseconds. It is still a
separate OS process: its own pid, memory, signal handlers, exit code and process group
membership, its own ``torch.distributed`` process group -- so rank processes, DiLoCo nodes,
signals and kills are tested for real. What it cannot test is a fresh interpreter's start-up
(``sys.path`` at launch, the console script, ``python -m``, torchrun): keep a real
``subprocess`` for those. Children also start within milliseconds of each other, not
seconds apart: a test must not depend on that spacing (wait for an explicit condition, or
assert what holds in every interleaving, as test_diloco_e2e's three nodes do).

Use it through the ``forked`` fixture (tests/conftest.py), which kills what a test left
running::

    def rank_main(out: str) -> int:          # a module-level function (pickled by name)
        ...                                  # runs in the child; the return value is its exit code

    def test_ranks(forked: Forked, tmp_path: Path) -> None:
        children = [forked.start(rank_main, str(tmp_path), env={"RANK": str(r)}) for r in (0, 1)]
        assert [child.wait(timeout=60) for child in children] == [0, 0], children[0].output

Put the child's function in a module of ``tests/`` (a test module works, but a small worker
module without pytest imports is cheaper to import in the child; add it to ``PRELOAD``
when many children use it). Arguments are pickled. The child sees the parent's environment
at ``start`` (with ``env`` applied; ``None`` removes a variable) and runs in ``cwd`` (default:
the parent's), exactly as ``subprocess`` would; stdout and stderr (file descriptors 1 and 2,
so C code and DataLoader workers too) go to ``child.output``. Synchronisation primitives for
a child (``Event``, ``Queue``) come from ``forked.context``.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from multiprocessing.context import ForkServerContext
from pathlib import Path

PRELOAD = [
    "torch",
    "torch._dynamo",  # imported lazily by the first optimizer step: ~2 s per child otherwise
    "torch.distributed",
    "numpy",
    "yaml",
    "jsonschema",
    "speedtronic",
    "speedtronic.cli",
    "speedtronic.runtime",
    "speedtronic.engine.trainer",
    "speedtronic_callbacks.checkpoint",
    "speedtronic_callbacks.jsonl",
    "speedtronic_callbacks.console",
    "speedtronic_callbacks.diloco",
    "speedtronic_callbacks.diloco.collective",
    "distributed_worker",  # tests/: the rank scenarios of test_distributed.py
]
"""Imported once by the fork server; a module missing here is imported by each child."""

context: ForkServerContext = multiprocessing.get_context("forkserver")
# The fork server is one per process and takes its preload list when it first starts.
context.set_forkserver_preload(PRELOAD)


def _child_main(
    target: Callable[..., int | None],
    args: tuple[object, ...],
    env: dict[str, str],
    cwd: str,
    output: str,
) -> None:
    """The child's first frame: the caller's environment, directory and output files."""
    fd = os.open(output, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # multiprocessing made "forkserver" this process's default start method; a fresh
    # interpreter has the platform default (DataLoader workers use it).
    multiprocessing.set_start_method(None, force=True)
    import torch

    torch.set_num_threads(1)
    code = target(*args)
    sys.stdout.flush()
    sys.stderr.flush()
    if isinstance(code, int) and code:
        sys.exit(code)  # multiprocessing turns SystemExit(n) into exit code n


def cli_main(*argv: str) -> int:
    """A target: ``speedtronic *argv`` as the child's whole life (its exit code), as the
    console script would run it minus the interpreter start-up."""
    from speedtronic.cli import main

    return main(list(argv))


def cli_main_stderr_to(stderr: str, *argv: str) -> int:
    """``cli_main`` with the child's stderr (file descriptor 2) in the file ``stderr``, so
    that ``child.output`` holds stdout alone."""
    fd = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    return cli_main(*argv)


class Child:
    """One forked child; the parts of ``subprocess.Popen`` the tests use."""

    def __init__(self, process: multiprocessing.process.BaseProcess, output: Path) -> None:
        self.process = process
        self._output = output
        assert process.pid is not None
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        """The exit code; ``-N`` for a child killed by signal N; ``None`` while it runs."""
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; ``TimeoutError`` if the child still runs after ``timeout`` s."""
        self.process.join(timeout)
        code = self.process.exitcode
        if code is None:
            raise TimeoutError(f"child {self.pid} still running after {timeout} s")
        return code

    def wait_for_output(self, text: str, timeout: float) -> str:
        """Wait until the child has written ``text``; what it wrote so far. Fails if the
        child exits first or ``timeout`` s pass."""
        deadline = time.monotonic() + timeout
        while True:
            output = self.output
            if text in output:
                return output
            code = self.poll()
            assert code is None, f"child exited with {code} before {text!r}:\n{output}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout} s:\n{output}"
            time.sleep(0.02)

    def send_signal(self, sig: int) -> None:
        if self.process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL the child (if it runs) and reap it."""
        self.send_signal(signal.SIGKILL)
        self.process.join(30)

    @property
    def output(self) -> str:
        """What the child wrote to stdout and stderr so far."""
        return self._output.read_text(encoding="utf-8", errors="replace")


class Forked:
    """Starts children from the preloaded fork server; ``close`` kills any still running."""

    context = context

    def __init__(self) -> None:
        self.children: list[Child] = []
        self._outputs = Path(tempfile.mkdtemp(prefix="speedtronic-forked-"))

    def start(
        self,
        target: Callable[..., int | None],
        *args: object,
        env: Mapping[str, str | None] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> Child:
        """Run ``target(*args)`` in a new child process; its return value is the exit code."""
        environment = dict(os.environ)
        for key, value in (env or {}).items():
            if value is None:
                environment.pop(key, None)
            else:
                environment[key] = value
        output = self._outputs / f"child-{len(self.children)}.out"
        output.touch()
        process = context.Process(
            target=_child_main,
            args=(target, args, environment, str(cwd or os.getcwd()), str(output)),
            # not daemonic: a daemonic process may not start children (DataLoader workers);
            # ``close`` (the fixture's teardown) kills what is left
        )
        process.start()
        child = Child(process, output)
        self.children.append(child)
        return child

    def close(self) -> None:
        for child in self.children:
            child.kill()
            child.process.close()
        for output in self._outputs.iterdir():
            output.unlink()
        self._outputs.rmdir()


def _nothing() -> None:
    pass


_warm: list[bool] = []


def start_server() -> None:
    """Start the fork server now, without waiting: it imports ``PRELOAD`` in the background
    (while other tests run) and the first child waits only for what is left of that."""
    from multiprocessing import forkserver

    forkserver.ensure_running()


def forked_children() -> Iterator[Forked]:
    """The ``forked`` fixture's body (tests/conftest.py). The first use waits until the fork
    server has imported ``PRELOAD`` (seconds), so that no test's own timing includes it."""
    if not _warm:
        warm_up = context.Process(target=_nothing)
        warm_up.start()
        warm_up.join()
        _warm.append(True)
    children = Forked()
    try:
        yield children
    finally:
        children.close()


__all__ = [
    "PRELOAD",
    "Child",
    "Forked",
    "cli_main",
    "cli_main_stderr_to",
    "context",
    "forked_children",
    "start_server",
]
