"""Hooks of the original API for W&B and TensorBoard (``MetricLogger(hooks=[...])``).

    logger = MetricLogger(hooks=[WandbHook(project="demo"), TensorboardHook("runs/tb")])

Both need the ``logging`` extra (``pip install 'speedtronic[logging]'``). Unlike the
original, ``WandbHook`` can be finished (``finish()``/``close()``), and both work as context
managers. New code should prefer the ``wandb`` and ``tensorboard`` sink callbacks, which
also resume runs and close themselves at teardown.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, cast

from typing_extensions import Self

from speedtronic.compat.metric_logger import Payload

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter
    from wandb.sdk.wandb_run import Run

__all__ = ["TensorboardHook", "WandbHook"]

_INSTALL_HINT = "pip install 'speedtronic[logging]'"


class _ClosingContext:
    def close(self) -> None:
        """Release the client (subclasses)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class WandbHook(_ClosingContext):
    """Logs every event to a W&B run: ``run.log({**payload, "event": event})``.

    ``settings`` are passed to ``wandb.init`` unchanged (``mode``, ``dir``, ``name``, ...).
    """

    def __init__(self, project: str | None = None, **settings: object) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(f"WandbHook needs wandb: {_INSTALL_HINT}") from exc
        # wandb.init's keywords are typed one by one; **settings is whatever the caller passed.
        init = cast(Callable[..., "Run"], wandb.init)
        self._run: Run | None = init(project=project, **settings)

    @property
    def run(self) -> Run | None:
        """The W&B run (``None`` once finished)."""
        return self._run

    def on_event(self, event: str, payload: Payload) -> None:
        if self._run is None:
            raise RuntimeError("WandbHook.on_event after finish()")
        self._run.log({**payload, "event": event})

    def finish(self) -> None:
        """Finish the W&B run (idempotent)."""
        run, self._run = self._run, None
        if run is not None:
            run.finish()

    def close(self) -> None:
        self.finish()


class TensorboardHook(_ClosingContext):
    """Writes every numeric payload value as the scalar ``<event>/<key>``.

    The TensorBoard step is the payload's integer ``step`` when it has one, else a per-event
    counter (so ``train_start``, ``train_end`` ... still get distinct points).
    """

    def __init__(self, log_dir: str | Path = "runs") -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(f"TensorboardHook needs tensorboard: {_INSTALL_HINT}") from exc
        self.log_dir = Path(log_dir)
        self._writer: SummaryWriter | None = SummaryWriter(log_dir=str(self.log_dir))
        self._counters: dict[str, int] = {}

    def on_event(self, event: str, payload: Payload) -> None:
        writer = self._writer
        if writer is None:
            raise RuntimeError("TensorboardHook.on_event after close()")
        step = payload.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            step = self._counters.get(event, 0)
            self._counters[event] = step + 1
        for key, value in payload.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            writer.add_scalar(f"{event}/{key}", float(value), step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the writer (idempotent)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
