"""``TrainerView``: everything a callback may read from, or ask of, the trainer.

Every hook receives ``trainer: TrainerView``. It is a ``typing.Protocol`` that the concrete
``Trainer`` satisfies structurally, so there is no wrapper object and no per-call cost: at
run time the hook gets the trainer itself, and mypy (plus the AST test
``tests/test_plugin_boundary.py`` over ``callbacks/``) makes sure a plugin uses nothing of
it beyond the members below. The counters, the model and the other members of the training
state are read from the one ``TrainingState`` the loop writes (``speedtronic.engine.state``;
``trainer.step`` is ``trainer.state.step``).

The members fall into two groups:

* **reads** -- the raw model, counters, device, precision, output directory, rank
  information, the run's redacted config as plain data, the training state for checkpoints;
* **requests** -- stop after this step, drop this step's update, reset the optimizer state.

Adding a member is a deliberate act: it widens the public plugin interface that every
downstream callback may rely on. Add it here with a docstring saying what it is for, make
the ``Trainer`` satisfy it, and document it in ``docs/callbacks.md``. Do not expose engine
internals (the data stream, the grad scaler, the optimizer object, the DDP wrapper); give
the view a member that says what the plugin needs them *for* instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from speedtronic.engine.notes import Notes
    from speedtronic.state.resume import ResumePoint
    from speedtronic.systems.distributed import DistributedContext

__all__ = ["TrainerView"]


class TrainerView(Protocol):
    """What plugins see of the trainer (see the module docstring for the rules)."""

    # -- the model and the optimizer -------------------------------------------------------

    @property
    def model(self) -> nn.Module:
        """The raw model (never the DDP or compiled wrapper)."""

    @property
    def trainable_parameters(self) -> Sequence[torch.Tensor]:
        """The parameters the optimizer updates (``requires_grad``), in model order."""

    @property
    def param_groups(self) -> Sequence[Mapping[str, object]]:
        """The optimizer's parameter groups (learning rate, weight decay, ...), read only."""

    def optimizer_state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the optimizer's per-parameter state (momenta, ...), for a
        checkpoint writer that needs to know which storages only the optimizer changes."""

    # -- counters --------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Global steps completed so far (the last completed step's number)."""

    @property
    def step_in_progress(self) -> int:
        """The global step the loop is running now -- the one a stop requested now ends
        after. ``step + 1`` until its optimizer update, ``step`` while its later hooks run
        (evaluation, metrics, checkpoint, ``step_end``); ``step + 1`` outside the loop."""

    @property
    def samples(self) -> int:
        """Samples consumed so far by this rank (all fits of this trainer, resumed included)."""

    @property
    def tokens(self) -> int:
        """Tokens consumed so far by this rank."""

    @property
    def target_step(self) -> int:
        """The absolute step this fit trains up to."""

    @property
    def accumulation_steps(self) -> int:
        """Microbatches per global step (K)."""

    @property
    def metrics_every(self) -> int:
        """The run's logging cadence: metrics are due every this many steps (and at the end)."""

    @property
    def eval_every(self) -> int:
        """Steps between evaluations of the held-out set during a fit (0: evaluation is
        off); the final step of a fit evaluates too. A callback that monitors an ``eval/*``
        metric checks it against this."""

    @property
    def last_loss(self) -> torch.Tensor | None:
        """The mean microbatch loss of the last completed step, a 0-d device tensor
        (``.item()`` forces a device sync)."""

    # -- where the run happens -------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """The device the model trains on."""

    @property
    def precision_mode(self) -> str:
        """The resolved precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``."""

    @property
    def uses_grad_scaler(self) -> bool:
        """True when an fp16 grad scaler is active (it skips overflowing steps itself)."""

    @property
    def output_dir(self) -> Path:
        """The run's output directory (relative plugin paths live under it)."""

    @property
    def distributed(self) -> DistributedContext | None:
        """This process's rank information in a distributed run, else ``None``."""

    @property
    def multi_rank(self) -> bool:
        """True in a distributed run with more than one rank."""

    @property
    def sharded_state(self) -> bool:
        """True when the training state is sharded across the ranks (``parallel.strategy:
        fsdp``): ``state_dict()`` holds this rank's shards, and every rank takes part in
        writing a checkpoint (``CheckpointManager.save`` on every rank, rank 0 commits)."""

    @property
    def run_id(self) -> str | None:
        """The run's id (``speedtronic.state.run_identity``; ``None``: a trainer built
        without one): the checkpoint plugin claims its object-store prefix under it."""

    @property
    def resumed_from(self) -> ResumePoint | None:
        """The checkpoint the run resumed from (path, step, and the newer checkpoints it
        fell back past because they could not be read), or ``None`` when it did not resume:
        for a plugin that tells newer files in its directory apart from another run's."""

    @property
    def run_config(self) -> Mapping[str, object] | None:
        """The run's validated config as plain data with secrets redacted (``None`` when
        the trainer was built without one), for sinks that log it."""

    @property
    def notes(self) -> Notes:
        """The run's board of optional named notes (``speedtronic.engine.notes``): publish what an
        observer may want to know that no event carries (``trainer.notes.publish("name",
        {...})``, from any thread); the 2.0 ``MetricLogger`` hands them to its hooks."""

    def evaluate(self) -> Mapping[str, float]:
        """Evaluate the model as it is now on the run's held-out set (``eval/loss``,
        ``eval/ppl``), for a plugin that swaps in other weights and wants their held-out
        loss (e.g. a synchronised global model). Changes no training state (RNG, data
        position, model mode) and emits no events. Only call it when ``eval_every > 0``
        (a held-out set exists); it raises ``EvaluationError`` otherwise."""

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        """Everything needed to continue this run exactly: what a checkpoint holds."""

    def data_position(self) -> Mapping[str, int]:
        """Where the data stream stands (part of ``state_dict()``), for a checkpoint that
        has to record the position at the end of a step."""

    @property
    def stop_requested(self) -> bool:
        """Whether a stop was requested on this rank."""

    # -- requests --------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        """Stop cleanly after the current step (``fit_end`` still runs)."""

    def request_optimizer_reset(self, requested_by: str) -> None:
        """Ask for an ``optimizer_reset`` in this step (honoured when resets are allowed)."""

    def skip_update(self) -> None:
        """Drop this step's gradients so the coming optimizer step changes nothing (no
        weight decay, no moment update). Call it at ``before_optimizer_step``."""
