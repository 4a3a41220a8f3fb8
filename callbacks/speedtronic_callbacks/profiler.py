"""``profiler``: a ``torch.profiler`` trace of a window of steps, and its top operators.

    callbacks:
      - {name: profiler, start_step: 10, wait: 1, warmup: 1, active: 3}

The profiler starts as global step ``start_step`` begins and follows torch's schedule from
there: ``wait`` steps idle, ``warmup`` steps traced and thrown away (the profiler's own
start-up lands there), ``active`` steps recorded -- the cycle ``repeat`` times. At the end of
each cycle the trace of its active steps is written into ``<output_dir>/profiler/`` (``dir``)
as ``rank<r>.<time_ns>.pt.trace.json``, the files ``torch.profiler.tensorboard_trace_handler``
writes: ``tensorboard --logdir <output_dir>/profiler`` shows them (with the
``torch-tb-profiler`` plugin), and each is a Chrome trace JSON that https://ui.perfetto.dev
or ``chrome://tracing`` opens. The trace's ``ProfilerStep#n`` spans count from the window's
first step (``n = step - start_step``). One line then names the file and the top operators
by self time (CUDA time on a GPU, CPU time otherwise; computed from the trace file,
``speedtronic_callbacks.profiler_summary``: operators only, each share of the time spent in
operators, so they add up to at most 100%), printed like the console's lines::

    profiler: rank 0 steps 3-5 -> runs/x/profiler/rank0.17...pt.trace.json | top self CPU
    (of 41.2 ms): aten::mm 9.1 ms (22%), aten::addmm 5.0 ms (12%), ...

and published as the note ``profiler`` (``trainer.notes``), with the trace path and the
operators. ``summaries`` keeps the lines.

No cost outside the window: the hooks are due (``due_when``) on the window's steps only, so
the loop does not call the callback before or after it. Only the ranks in ``ranks`` (``[0]``
by default, or ``all``) profile; each writes its own file. A fit that ends inside the window
stops the profiler at ``teardown`` and writes what it recorded. A failure here (a full disk)
is reported once and training goes on (``is_observer``).
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

from tqdm import tqdm

from speedtronic.config.declare import Opt, plugin
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import FitContext, StepContext, TeardownContext
from speedtronic.engine.events import Event
from speedtronic.engine.filters import StepFilter, once
from speedtronic.state.run_lock import RunPaths
from speedtronic_callbacks.profiler_summary import OperatorTime, read_trace_events, top_operators
from speedtronic_callbacks.sink import resolve_path, under_output_dir

if TYPE_CHECKING:
    from torch.profiler import profile

    from speedtronic.engine.notes import Notes
    from speedtronic.engine.view import TrainerView

__all__ = ["OperatorTime", "Profiler", "top_operators"]

logger = logging.getLogger("speedtronic.profiler")

_DEFAULT_DIR = "profiler"
_TRACE_SUFFIX = ".pt.trace.json"
Ranks = Literal["all"] | Sequence[int]


def _milliseconds(us: float) -> str:
    return f"{us / 1e3:.3g} ms"


@dataclass(frozen=True)
class ProfilerOptions:
    """The ``profiler`` plugin's options."""

    start_step: Annotated[
        int,
        Opt(
            "the global step the window starts at (its `wait` begins)",
            minimum=1,
            maximum=1_000_000_000,
        ),
    ] = 1
    wait: Annotated[
        int, Opt("steps of each cycle the profiler idles through first", minimum=0, maximum=1000)
    ] = 1
    warmup: Annotated[
        int, Opt("steps traced and discarded before the recorded ones", minimum=0, maximum=100)
    ] = 1
    active: Annotated[
        int, Opt("steps recorded into the trace, per cycle", minimum=1, maximum=100)
    ] = 3
    repeat: Annotated[
        int,
        Opt("cycles (`wait`, `warmup`, `active`), one trace file each", minimum=1, maximum=10),
    ] = 1
    ranks: Annotated[
        list[int] | Literal["all"],
        Opt(
            "the ranks that profile: a list of ranks, or `all`",
            # One schema for both forms (not anyOf), so a mistake is named precisely: a
            # string must be "all", a list holds distinct ranks >= 0.
            schema={
                "type": ["array", "string"],
                "pattern": "^all$",
                "items": {"type": "integer", "minimum": 0},
                "minItems": 1,
                "uniqueItems": True,
            },
            type_text="list of ints or `all`",
        ),
    ] = field(default_factory=lambda: [0])
    dir: Annotated[str, Opt("trace directory, relative to the output directory", min_length=1)] = (
        _DEFAULT_DIR
    )
    record_shapes: Annotated[
        bool, Opt("record operator input shapes (`torch.profiler.profile`)")
    ] = False
    profile_memory: Annotated[bool, Opt("record tensor memory allocations")] = False
    with_stack: Annotated[bool, Opt("record the Python stack of each operator (costly)")] = False
    top: Annotated[int, Opt("operators named in the summary line", minimum=1, maximum=50)] = 5


@plugin("profiler", options=ProfilerOptions, build=under_output_dir("dir"))
class Profiler(Callback):
    """Records a ``torch.profiler`` trace of a window of steps (module docstring)."""

    is_observer: ClassVar[bool] = True

    def __init__(
        self,
        *,
        start_step: int = ProfilerOptions.start_step,
        wait: int = ProfilerOptions.wait,
        warmup: int = ProfilerOptions.warmup,
        active: int = ProfilerOptions.active,
        repeat: int = ProfilerOptions.repeat,
        ranks: Ranks = (0,),
        dir: str | Path = ProfilerOptions.dir,
        record_shapes: bool = ProfilerOptions.record_shapes,
        profile_memory: bool = ProfilerOptions.profile_memory,
        with_stack: bool = ProfilerOptions.with_stack,
        top: int = ProfilerOptions.top,
    ) -> None:
        for name, value, least in (
            ("start_step", start_step, 1),
            ("wait", wait, 0),
            ("warmup", warmup, 0),
            ("active", active, 1),
            ("repeat", repeat, 1),
            ("top", top, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"profiler: {name} must be an integer >= {least}, got {value!r}")
        if ranks != "all" and (
            isinstance(ranks, str)
            or not ranks
            or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks)
        ):
            raise ValueError(f"profiler: ranks must be 'all' or a list of ranks, got {ranks!r}")
        self.start_step, self.wait, self.warmup = start_step, wait, warmup
        self.active, self.repeat, self.top = active, repeat, top
        self.ranks: Literal["all"] | frozenset[int] = "all" if ranks == "all" else frozenset(ranks)
        self.dir = Path(dir)
        self.record_shapes = record_shapes
        self.profile_memory = profile_memory
        self.with_stack = with_stack
        self.summaries: list[str] = []
        """The summary line of every trace written, in order."""
        self.traces: list[Path] = []
        """The trace files written, in order."""
        self._profile: profile | None = None
        self._stepped = 0
        self._rank = 0
        self._on_device = False
        self._notes: Notes | None = None
        self._failure: Exception | None = None
        self._resolved = self.dir
        self.due_when = {
            Event.STEP_START: once(start_step),
            Event.STEP_END: StepFilter(at=frozenset(range(start_step, self.last_step + 1))),
        }

    @property
    def cycle(self) -> int:
        """Steps per cycle: ``wait + warmup + active``."""
        return self.wait + self.warmup + self.active

    @property
    def last_step(self) -> int:
        """The window's last global step."""
        return self.start_step + self.repeat * self.cycle - 1

    def active_steps(self, cycle: int) -> tuple[int, int]:
        """The first and last global step recorded by cycle number ``cycle`` (0-based)."""
        first = self.start_step + cycle * self.cycle + self.wait + self.warmup
        return first, first + self.active - 1

    def run_paths(self, output_dir: Path) -> RunPaths:
        """The trace directory, locked for the run (another run's traces would mix in)."""
        return RunPaths(directories=(resolve_path(self.dir, output_dir),))

    # -- hooks --------------------------------------------------------------------------

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None:
        distributed = trainer.distributed
        self._rank = distributed.rank if distributed is not None else 0
        self._on_device = trainer.device.type == "cuda"
        self._notes = trainer.notes
        self._resolved = resolve_path(self.dir, trainer.output_dir)
        self._stepped = 0

    def _profiles_here(self) -> bool:
        return self.ranks == "all" or self._rank in self.ranks

    def on_step_start(self, trainer: TrainerView, ctx: StepContext) -> None:
        if self._profile is not None or not self._profiles_here():
            return
        from torch.profiler import ProfilerActivity, schedule
        from torch.profiler import profile as new_profile

        activities = [ProfilerActivity.CPU]
        if self._on_device:
            activities.append(ProfilerActivity.CUDA)
        self._profile = new_profile(
            activities=activities,
            schedule=schedule(
                wait=self.wait, warmup=self.warmup, active=self.active, repeat=self.repeat
            ),
            on_trace_ready=self._write_trace,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
        )
        self._stepped = 0
        self._profile.start()

    def on_step_end(self, trainer: TrainerView, ctx: StepContext) -> None:
        prof = self._profile
        if prof is None:
            return
        self._stepped += 1  # steps of the window done (this one included)
        with warnings.catch_warnings():
            # Each cycle is summarised on its own: that its events are cleared is the point.
            warnings.filterwarnings("ignore", "Warning: Profiler clears events")
            prof.step()  # the schedule's next step; at a cycle's end: _write_trace
        failure, self._failure = self._failure, None
        # The last step of the window ends it, also when a retried (skipped fp16) step took
        # one of its schedule's steps; a trace that could not be written ends it too.
        done = self._stepped >= self.repeat * self.cycle or ctx.step >= self.last_step
        if done or failure is not None:
            self._stop()
        if failure is not None:
            raise failure  # reported once (an observer); training goes on

    def on_teardown(self, trainer: TrainerView, ctx: TeardownContext) -> None:
        self._stop()  # a fit that ended inside the window: what was recorded is written
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def _stop(self) -> None:
        prof, self._profile = self._profile, None
        if prof is not None:
            prof.stop()

    # -- the trace ------------------------------------------------------------------------

    def _write_trace(self, prof: profile) -> None:
        """``on_trace_ready``: write the trace, then print and publish its summary. A failure
        is kept for the hook to raise once the profiler's own step is over: raised from
        inside it, it would leave torch's profiler half-switched (and crash its ``stop``)."""
        try:
            self._write_and_summarise(prof)
        except Exception as exc:
            self._failure = self._failure or exc

    def _write_and_summarise(self, prof: profile) -> None:
        cycle = len(self.traces)
        self._resolved.mkdir(parents=True, exist_ok=True)
        path = self._resolved / f"rank{self._rank}.{time.time_ns()}{_TRACE_SUFFIX}"
        prof.export_chrome_trace(str(path))
        self.traces.append(path)
        first, last = self.active_steps(cycle)
        last = max(first, min(last, self.start_step + self._stepped - 1))  # cut short?
        # From the file, not prof.key_averages() (profiler_summary: dangling Python names
        # with with_stack, and Python frames' negative self times in the total).
        events = read_trace_events(path)
        operators, total = top_operators(events, device=self._on_device, count=self.top)
        kind = "CUDA" if self._on_device else "CPU"
        named = ", ".join(
            f"{op.name} {_milliseconds(op.self_us)} ({100 * op.self_us / total:.0f}%)"
            for op in operators
            if total > 0
        )
        line = (
            f"profiler: rank {self._rank} steps {first}-{last} -> {path} | top self {kind} "
            f"(of {_milliseconds(total)}): {named or 'no operators recorded'}"
        )
        self.summaries.append(line)
        tqdm.write(line, file=sys.stdout)
        logger.info("%s", line)
        if self._notes is not None:
            self._notes.publish(
                "profiler",
                {
                    "rank": self._rank,
                    "steps": [first, last],
                    "trace": str(path),
                    "time": kind.lower(),
                    "top": [[op.name, op.self_us] for op in operators],
                },
            )
