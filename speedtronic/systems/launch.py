"""``speedtronic fit --nproc-per-node N``: start the ranks of a run, as ``torchrun`` would,
and exit the way the run did.

The ranks are started through ``torch.distributed.run``'s own API (``elastic_launch`` with a
``LaunchConfig``): one ``python -m speedtronic fit ...`` process per rank, with the same
arguments minus the launcher's flags and the torchrun variables set. What differs from
``torchrun`` is what a job script sees:

* the exit code is the run's own: 0, 2 (a mistake in the config or the data), 75 (the time
  budget ran out: requeue), 130 / 143 (stopped by SIGINT / SIGTERM, checkpoint saved),
  1 otherwise (``run_exit_code`` picks it from the ranks' codes). ``torchrun`` exits 1 for
  all of them, so a requeue wrapper that checks 75 and 143 never requeues;
* SIGTERM and SIGINT sent to the launcher go to every rank (the ranks run in sessions of
  their own, so a terminal's Ctrl-C reaches them through the launcher once, not twice),
  and the launcher waits up to ``SHUTDOWN_TIMEOUT_S`` for them to save and exit;
* the outcome is one line on stderr, never the agent's traceback or failure table (the
  ranks print their own errors).

Single node by default (a local rendezvous on a free port, like ``torchrun --standalone``);
``--nnodes`` and ``--rdzv-endpoint HOST:PORT`` join the nodes of a multi-node job through
the c10d rendezvous, under the id ``speedtronic-$SLURM_JOB_ID`` (``speedtronic`` outside
SLURM), which every node of one job shares.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "SHUTDOWN_TIMEOUT_S",
    "LaunchError",
    "LaunchOptions",
    "launch_fit",
    "rank_arguments",
    "run_exit_code",
]

_LAUNCH_FLAGS = ("--nproc-per-node", "--nnodes", "--rdzv-endpoint")
"""The launcher's own flags (each takes a value); the ranks get the other arguments."""
SHUTDOWN_TIMEOUT_S = 3600
"""How long a signalled launcher waits for the ranks to reach their stop step, save and
exit before it kills them."""
EXIT_FAILED = 1


class LaunchError(ValueError):
    """A launcher flag the launcher cannot use (a user mistake: exit 2)."""


@dataclass(frozen=True)
class LaunchOptions:
    """The launcher's flags."""

    nproc_per_node: int
    nnodes: str = "1"
    rdzv_endpoint: str | None = None

    def node_range(self) -> tuple[int, int]:
        """``(min_nodes, max_nodes)`` of ``--nnodes`` (``N`` or ``MIN:MAX``)."""
        parts = self.nnodes.split(":")
        try:
            low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
        except ValueError:
            low = high = 0
        if not 1 <= low <= high:
            raise LaunchError(f"--nnodes: {self.nnodes!r} is not N or MIN:MAX (N >= 1)")
        return low, high


def rank_arguments(argv: Sequence[str]) -> list[str]:
    """``argv`` without the launcher's flags and their values (``--flag V`` or
    ``--flag=V``): what each rank runs."""
    kept: list[str] = []
    skip = False
    for argument in argv:
        if skip:
            skip = False
        elif argument in _LAUNCH_FLAGS:
            skip = True
        elif not argument.startswith(tuple(f"{flag}=" for flag in _LAUNCH_FLAGS)):
            kept.append(argument)
    return kept


def run_exit_code(codes: dict[int, int]) -> int:
    """The run's exit code from the failed ranks' codes (``rank -> code``, negative for a
    rank killed by that signal). Once one rank has failed the agent stops the others with
    SIGTERM (they exit 143, or -15 during teardown), so a code a rank chose itself (below
    128: 1, 2, 75) speaks for the run -- rank 0's, else the lowest rank's; only when every
    failure is a signal's does that signal's code (``128 + N``) do."""
    if not codes:
        return 0
    chosen = {rank: code for rank, code in codes.items() if 0 < code < 128} or codes
    code = chosen[0 if 0 in chosen else min(chosen)]
    return 128 - code if code < 0 else code


def _config(options: LaunchOptions) -> object:
    from torch.distributed.launcher.api import LaunchConfig

    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ:
        raise LaunchError(
            "--nproc-per-node: this process is already a rank (started by torchrun or a "
            "launcher); drop the launcher flags, or start speedtronic without torchrun"
        )
    if options.nproc_per_node < 1:
        raise LaunchError(f"--nproc-per-node: {options.nproc_per_node} is not a positive count")
    low, high = options.node_range()
    if options.rdzv_endpoint is None and high > 1:
        raise LaunchError("--nnodes above 1 needs --rdzv-endpoint HOST:PORT (the first node's)")
    standalone = options.rdzv_endpoint is None
    job = os.environ.get("SLURM_JOB_ID")
    return LaunchConfig(
        min_nodes=low,
        max_nodes=high,
        nproc_per_node=options.nproc_per_node,
        run_id=str(uuid.uuid4()) if standalone else f"speedtronic-{job}" if job else "speedtronic",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0" if standalone else str(options.rdzv_endpoint),
        max_restarts=0,  # a failed run is the scheduler's to requeue, not restarted here
        monitor_interval=0.1,
        start_method="spawn",
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )


def launch_fit(options: LaunchOptions, argv: Sequence[str]) -> int:
    """Run ``speedtronic <argv>`` (launcher flags removed) on ``options``' ranks; the run's
    exit code (module docstring), after one line on stderr when it is not 0."""
    config = _config(options)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    # torchrun's default: one thread per rank unless the user said otherwise.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    arguments = ["-m", "speedtronic", *rank_arguments(argv)]
    quiet = _quiet_elastic_loggers()  # their failure tables: the one line below says it
    try:
        elastic_launch(config, sys.executable)(*arguments)  # type: ignore[arg-type]  # LaunchConfig
    except ChildFailedError as exc:
        codes = {int(rank): int(failure.exitcode) for rank, failure in exc.failures.items()}
        code = run_exit_code(codes)
        listed = ", ".join(f"rank {rank}: {codes[rank]}" for rank in sorted(codes))
        print(f"speedtronic: the run exited with {code} ({listed})", file=sys.stderr)
        return code
    except SignalException as exc:
        received = signal.Signals(exc.sigval)
        code = 128 + int(received)
        print(
            f"speedtronic: received {received.name}: the ranks were stopped (each saves its "
            f"checkpoint first); exiting {code}",
            file=sys.stderr,
        )
        return code
    except Exception as exc:  # a rendezvous that failed: the ranks never ran
        print(f"speedtronic: error: the ranks could not be started: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        for logger, level in quiet.items():
            logger.setLevel(level)
    return 0


def _quiet_elastic_loggers() -> dict[logging.Logger, int]:
    """Raise the level of torch elastic's loggers (some set their own) to CRITICAL; their
    levels before, to put back."""
    prefix = "torch.distributed.elastic"
    names = [prefix, *(name for name in logging.root.manager.loggerDict if name.startswith(prefix))]
    loggers = [logging.getLogger(name) for name in names]
    before = {logger: logger.level for logger in loggers}
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    return before
