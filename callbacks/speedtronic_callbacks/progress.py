"""``progress``: a tqdm progress bar on a terminal, plain log lines anywhere else.

On a TTY the bar shows steps, ETA (tqdm's smoothed rate), and the latest loss, learning
rate and tokens/s as its postfix, then every key a callback logs (``sink.other_keys``). The
bar advances every step (a counter update, no device sync); the postfix changes on due
records only. When the stream is not a terminal (CI logs,
``> file``) there is no bar: each due record becomes one line with percent done, elapsed
time and ETA, optionally thinned out with ``min_interval_s``.

Other text printed while the bar is drawn should go through ``tqdm.write`` (the ``console``
sink does) so lines and bar never tear each other apart.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Annotated, ClassVar, Literal

from tqdm import tqdm
from typing_extensions import Never

from speedtronic.config.declare import Opt, plugin
from speedtronic.engine.callback import Callback, RankPolicy
from speedtronic.engine.contexts import (
    FitContext,
    FitEndContext,
    MetricsContext,
    StepContext,
    TeardownContext,
)
from speedtronic.engine.filters import METRICS_ON_LOGGING_STEPS
from speedtronic_callbacks.sink import (
    NumberFormat,
    Record,
    format_duration,
    format_float,
    format_si,
    format_value,
    formatted_numbers,
    other_keys,
)

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView

Mode = Literal["auto", "bar", "lines"]
StreamName = Literal["stdout", "stderr"]


_POSTFIX_KEYS = frozenset({"loss", "eval/loss", "lr", "tokens_per_sec"})


def _postfix(record: Record, other: bool = True) -> str:
    parts = []
    loss = record.get("loss")
    if isinstance(loss, (int, float)):
        parts.append(f"loss={format_float(float(loss))}")
    eval_loss = record.get("eval/loss")
    if isinstance(eval_loss, (int, float)):
        parts.append(f"eval/loss={format_float(float(eval_loss))}")
    lr = record.get("lr")
    if isinstance(lr, (int, float)):
        parts.append(f"lr={float(lr):.2e}")
    tokens_per_sec = record.get("tokens_per_sec")
    if isinstance(tokens_per_sec, (int, float)):
        parts.append(f"tok/s={format_si(float(tokens_per_sec))}")
    if other:
        shown = _POSTFIX_KEYS | _LINE_KEYS  # the bar shows rates and time itself
        parts += [f"{key}={format_value(key, record[key])}" for key in other_keys(record, shown)]
    return ", ".join(parts)


_PROGRESS_LINE_FIELDS: tuple[NumberFormat, ...] = (
    ("loss", lambda v: f"loss {format_float(v)}"),
    ("eval/loss", lambda v: f"eval/loss {format_float(v)}"),
    ("lr", lambda v: f"lr {v:.2e}"),
    ("tokens_per_sec", lambda v: f"{format_si(v)} tok/s"),
    ("elapsed_s", lambda v: f"elapsed {format_duration(v)}"),
)


_LINE_KEYS = frozenset(key for key, _ in _PROGRESS_LINE_FIELDS) | {
    "steps_per_sec",
    "grad_norm",
    "eval/ppl",
}
"""Keys the progress output shows in its own way, and the trainer's keys it leaves to the
``console`` line to stay short; every key a callback logs is appended (``other_keys``)."""


def progress_line(record: Record, start_step: int, target_step: int, other: bool = True) -> str:
    """The non-TTY line: ``step 10/100 (10%) | loss .. | lr .. | .. tok/s | elapsed | eta``,
    then (``other``) every other key a callback logged."""
    step = int(record["step"])
    percent = 100.0 * step / target_step if target_step else 100.0
    parts = [f"step {step}/{target_step} ({percent:.0f}%)"]
    parts += formatted_numbers(record, _PROGRESS_LINE_FIELDS)
    rate = record.get("steps_per_sec")
    if isinstance(rate, (int, float)) and rate > 0 and step > start_step:
        parts.append(f"eta {format_duration((target_step - step) / float(rate))}")
    if other:
        parts += [
            f"{key} {format_value(key, record[key])}" for key in other_keys(record, _LINE_KEYS)
        ]
    return " | ".join(parts)


@dataclass(frozen=True)
class ProgressOptions:
    """The ``progress`` sink's options."""

    mode: Annotated[Mode, Opt("`auto`: a bar when the stream is a terminal, lines otherwise")] = (
        "auto"
    )
    stream: Annotated[StreamName, Opt("the stream written to")] = "stdout"
    min_interval_s: Annotated[
        float,
        Opt(
            "lines mode: at most one line per this many seconds (the final step always prints)",
            minimum=0,
        ),
    ] = 0.0
    leave: Annotated[bool, Opt("keep the finished bar on screen")] = True
    other_keys: Annotated[
        bool,
        Opt(
            "also show every key a callback logs (in the bar's postfix or the line); `false`: "
            "only loss, eval/loss, lr and tokens/s"
        ),
    ] = True


@plugin("progress", options=ProgressOptions)
class ProgressBarCallback(Callback):
    """A progress bar (tqdm) when the stream is a terminal; plain lines otherwise."""

    is_observer: ClassVar[bool] = True
    metrics_phase: ClassVar[Literal["contribute", "consume"]] = "consume"
    rank_policy: ClassVar[RankPolicy] = "main"  # one bar per run, drawn by rank 0
    due_when = METRICS_ON_LOGGING_STEPS  # the bar advances at step_end, records on logging steps

    def __init__(
        self,
        *,
        mode: Mode = ProgressOptions.mode,
        stream: StreamName | IO[str] = ProgressOptions.stream,
        min_interval_s: float = ProgressOptions.min_interval_s,
        leave: bool = ProgressOptions.leave,
        other_keys: bool = ProgressOptions.other_keys,
    ) -> None:
        if min_interval_s < 0:
            raise ValueError(f"min_interval_s must be >= 0, got {min_interval_s}")
        self.mode: Mode = mode
        self.stream = stream
        self.min_interval_s = float(min_interval_s)
        self.leave = leave
        self.other_keys = other_keys
        self._bar: tqdm[Never] | None = None
        self._lines_stream: IO[str] | None = None
        self._start_step = 0
        self._last_line_time = float("-inf")

    def _resolve_stream(self) -> IO[str]:
        if self.stream == "stdout":
            return sys.stdout
        if self.stream == "stderr":
            return sys.stderr
        assert not isinstance(self.stream, str)
        return self.stream

    def _wants_bar(self, stream: IO[str]) -> bool:
        if self.mode != "auto":
            return self.mode == "bar"
        isatty = getattr(stream, "isatty", None)
        return bool(isatty()) if callable(isatty) else False

    @property
    def uses_bar(self) -> bool:
        """True while a tqdm bar is drawn (between fit start and fit end)."""
        return self._bar is not None

    # -- hooks --------------------------------------------------------------------------

    def on_fit_start(self, trainer: TrainerView, ctx: FitContext) -> None:
        stream = self._resolve_stream()
        self._start_step = ctx.start_step
        self._last_line_time = float("-inf")
        if self._wants_bar(stream):
            self._bar = tqdm(
                total=ctx.target_step,
                initial=ctx.start_step,
                desc="train",
                unit="step",
                file=stream,
                dynamic_ncols=True,
                leave=self.leave,
                mininterval=0.25,
                smoothing=0.1,
            )
        else:
            self._lines_stream = stream

    def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        bar = self._bar
        if bar is not None:
            bar.set_postfix_str(_postfix(ctx.record.finished(), self.other_keys), refresh=False)
            return
        if self._lines_stream is None:
            return
        now = time.monotonic()
        final = ctx.step >= trainer.target_step
        if final or now - self._last_line_time >= self.min_interval_s:
            self._last_line_time = now
            record = ctx.record.finished()
            line = progress_line(record, self._start_step, trainer.target_step, self.other_keys)
            tqdm.write(line, file=self._lines_stream)

    def on_step_end(self, trainer: TrainerView, ctx: StepContext) -> None:
        bar = self._bar
        if bar is not None and trainer.step > bar.n:  # not after a skipped (fp16) step
            bar.update(trainer.step - bar.n)

    def on_fit_end(self, trainer: TrainerView, ctx: FitEndContext) -> None:
        if self._bar is not None:
            self._close_bar()
        elif self._lines_stream is not None and ctx.stop_reason is not None:
            tqdm.write(
                f"stopped at step {ctx.result.steps}: {ctx.stop_reason}", file=self._lines_stream
            )

    def on_teardown(self, trainer: TrainerView, ctx: TeardownContext) -> None:
        self._close_bar()
        self._lines_stream = None

    def _close_bar(self) -> None:
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()
