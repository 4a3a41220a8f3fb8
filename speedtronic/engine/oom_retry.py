"""Out-of-memory recovery: ``data.micro_batch_size: auto``.

The run starts with the whole per-rank step as one micro-batch (``target_batch_size``, no
accumulation). When a microbatch's forward or backward raises ``torch.OutOfMemoryError``,
the partial step is dropped (gradients set to None, the failed step's references released,
the CUDA cache emptied), the micro-batch becomes its largest divisor no larger than half of
it and the accumulation grows to match, so the global batch -- and the gradient, a mean over
the same samples -- stay the same. The step then runs again from its start over the same
samples: the data stream is put back where the step began, re-sliced at the new size.

Several DDP ranks agree before the first step: each tries the step's first microbatch with
the bare model (no DDP hook, no collective), shrinking until it fits, and one ``all_reduce``
(MIN) of the sizes picks the run's. Mid-run, each step ends its microbatches' forwards with
one more MIN all-reduce of the size each rank wants (``engine.oom_agreement``), before the
backward that all-reduces the gradients: a rank that ran out of memory joins it from here
with the smaller size, the others from the last forward, and all of them run the step again
at the agreed size. An OOM in that last backward cannot be recovered (the gradient
all-reduce is in flight) and ends the run saying so. FSDP2 on several ranks searches the
first step with every parameter gathered and no collective inside a try
(``engine.oom_probe``); after it, FSDP's collectives run inside every forward and backward,
so a mid-run OOM ends the run naming the integer size to resume with. Tensor parallelism is
refused. The choice is logged and, as the batch layout (``engine.batch_layout``), written
into every checkpoint; a resume on the same ranks reuses it (``auto_resume_layout``).

On one process nothing here runs per step but a ``try`` and four reads of the step's start
(the data position and the sample/token counters); several ranks add the agreement -- see
docs/performance.md.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from speedtronic.engine.batch import move_to_device, resolve_loss, run_model
from speedtronic.engine.batch_layout import (
    BatchLayout,
    apply_layout,
    current_layout,
    saved_layout,
)
from speedtronic.engine.loop import _accumulate_microbatches, run_global_step
from speedtronic.engine.oom_agreement import RanksShrink, StepAgreement, step_agreement

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

    from speedtronic.engine.state import TrainingState
    from speedtronic.engine.trainer import Trainer

__all__ = ["MicroBatchError", "OomRecovery", "auto_resume_layout"]

logger = logging.getLogger(__name__)

_MICROBATCH_CODE = _accumulate_microbatches.__code__


class MicroBatchError(RuntimeError):
    """``micro_batch_size: auto`` cannot run: not even one sample fits, or the data or the
    parallel layout gives it nothing to adjust."""


def _smaller(micro: int) -> int:
    """The largest divisor of ``micro`` no larger than half of it (``micro`` > 1)."""
    return max(d for d in range(1, micro // 2 + 1) if micro % d == 0)


def _head(batch: object, n: int) -> object:
    """The first ``n`` samples of a batch (tensors sliced on their first dimension)."""
    if isinstance(batch, torch.Tensor):
        return batch[:n]
    if isinstance(batch, (tuple, list)):
        return type(batch)(_head(value, n) for value in batch)
    if isinstance(batch, Mapping):
        return {key: _head(value, n) for key, value in batch.items()}
    return batch


def _in_microbatches(error: BaseException) -> bool:
    """Whether ``error`` rose from a microbatch's forward/backward (not the optimizer)."""
    frame = error.__traceback__
    while frame is not None:
        if frame.tb_frame.f_code is _MICROBATCH_CODE:
            return True
        frame = frame.tb_next
    return False


def _memory_text(device: torch.device, error: str) -> str:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return f"{device} has {total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free): {error}"
    return f"{device}: {error}"


def _in_flight_text(layout: BatchLayout | None, error: str) -> str:
    """Why an OOM in the synchronising backward ends a run of several ranks."""
    smaller = f" ({_smaller(layout.micro)} or less)" if layout and layout.micro > 1 else ""
    return (
        "data.micro_batch_size: auto: out of memory in the backward pass of the step's last "
        "microbatch (or its loss), after the ranks agreed on its size: DDP's gradient "
        "all-reduce is in flight on the other ranks there, so the step cannot be run again "
        "at a smaller size; "
        f"resume from the last checkpoint with a smaller integer data.micro_batch_size{smaller} "
        f"and the same target_batch_size ({error})"
    )


def _none_fits(device: torch.device, error: str) -> MicroBatchError:
    """The ranks agreed on 0: this rank (``error``) or another cannot fit 1 sample."""
    where = _memory_text(device, error) if error else "another rank (its log names the device)"
    return MicroBatchError(
        f"data.micro_batch_size: auto: a micro-batch of 1 sample does not fit in the memory of "
        f"{where}"
    )


class OomRecovery:
    """Runs global steps for a fit with ``micro_batch_size: auto`` (module docstring)."""

    def __init__(self, trainer: Trainer, state: TrainingState) -> None:
        layout = current_layout(trainer)
        if layout is None:
            raise MicroBatchError(
                "data.micro_batch_size: auto needs a data loader whose batch size can change "
                "(a DataLoader with a BatchSampler, as build_dataloader makes); this data has "
                "fixed batches"
            )
        self._fsdp: FSDPModule | None = None
        if state.multi_rank and trainer.settings.parallel != "ddp":
            self._fsdp = _probe_root(trainer, state)
        self._agree_first = state.multi_rank
        self._agreement: StepAgreement | None = None
        ddp = trainer.forward_path.ddp
        if state.multi_rank and ddp is not None:
            assert state.distributed is not None  # multi_rank
            self._agreement = step_agreement(ddp, state.distributed.collective_device)
            self._agreement.micro = layout.micro
            trainer.forward_path.grad_sync_context = self._agreement.grad_sync_context

    def run_step(self, t: Trainer, s: TrainingState, step: int) -> bool:
        """``loop.run_global_step``, run again at a smaller micro-batch after an OOM."""
        if self._agree_first:
            self._agree_first = False
            self._agree(t, s)
        while True:
            stream = s.stream
            start = (stream.epoch, stream.batches_in_epoch, s.samples, s.tokens)
            try:
                return run_global_step(t, s, step)
            except RanksShrink as exc:  # this rank fitted; another did not
                agreed, message = exc.micro, ""
            except torch.OutOfMemoryError as exc:
                if self._fsdp is not None and _in_microbatches(exc):
                    raise MicroBatchError(_fsdp_mid_run_text(current_layout(t), str(exc))) from None
                if not _in_microbatches(exc) or (s.multi_rank and self._agreement is None):
                    raise  # the optimizer's, or ranks without an agreement (a replica of 1)
                agreed, message = None, str(exc)
                if self._agreement is not None and self._agreement.armed:
                    raise MicroBatchError(_in_flight_text(current_layout(t), message)) from None
            # Out of the except block: the traceback, and the activations its frames held,
            # are gone.
            s.optimizer.zero_grad(set_to_none=True)
            if s.device.type == "cuda":
                torch.cuda.empty_cache()
            if self._agreement is None:
                self._shrink(t, s, start, message)
                continue
            if agreed is None:  # this rank ran out of memory: the others wait in the agreement
                micro = self._agreement.micro
                agreed = self._agreement.agree(_smaller(micro) if micro > 1 else 0)
            self._adopt(t, s, start, agreed, message)

    def _shrink(
        self, t: Trainer, s: TrainingState, start: tuple[int, int, int, int], error: str
    ) -> None:
        layout = current_layout(t)
        assert layout is not None  # checked at construction
        if layout.micro == 1:
            raise MicroBatchError(
                "data.micro_batch_size: auto: a micro-batch of 1 sample does not fit in the "
                f"memory of {_memory_text(s.device, error)}"
            )
        self._switch(t, s, start, _smaller(layout.micro), f"out of memory ({error})")

    def _adopt(
        self,
        t: Trainer,
        s: TrainingState,
        start: tuple[int, int, int, int],
        agreed: int,
        error: str,
    ) -> None:
        """Run the step again at the size the ranks ``agreed`` on after a mid-run OOM."""
        if agreed == 0:
            raise _none_fits(s.device, error)
        why = f"out of memory ({error})" if error else "another rank ran out of memory"
        self._switch(t, s, start, agreed, why)

    def _switch(
        self, t: Trainer, s: TrainingState, start: tuple[int, int, int, int], micro: int, why: str
    ) -> None:
        """Run with ``micro`` from the step that began at ``start``, over the same samples."""
        layout = current_layout(t)
        assert layout is not None
        epoch, batches, s.samples, s.tokens = start
        stream = s.stream
        position = stream.state_dict()
        position.pop("samples", None)  # the cursor of the failed step's end
        position["epoch"] = epoch
        position["batches_in_epoch"] = batches * layout.micro // micro
        stream.abandon()
        new = BatchLayout(micro, layout.micro * layout.accumulation // micro, layout.ranks)
        apply_layout(t, new)
        if self._agreement is not None:
            self._agreement.micro = micro
        stream.load_state_dict(position)
        logger.warning(
            "data.micro_batch_size auto: micro-batch %d -> %d, accumulation %d -> %d "
            "(global batch %s) after %s",
            layout.micro,
            new.micro,
            layout.accumulation,
            new.accumulation,
            new.describe(),
            why,
        )

    def _agree(self, t: Trainer, s: TrainingState) -> None:
        """Before the first step of several ranks: the largest micro-batch every rank fits
        (each tries alone, then one MIN all-reduce)."""
        stream, layout = s.stream, current_layout(t)
        assert layout is not None
        start = (stream.epoch, stream.batches_in_epoch, s.samples, s.tokens)
        batch = next(stream)
        if s.device.type != "cpu":
            batch = move_to_device(batch, s.device)
        buffers = [buffer.detach().clone() for buffer in s.model.buffers()]
        devices = [s.device] if s.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            agreed, error = self._search(t, s, batch, layout.micro)
        del batch
        for buffer, saved in zip(s.model.buffers(), buffers, strict=True):
            buffer.copy_(saved)
        if agreed == 0:
            raise _none_fits(s.device, error)
        if agreed == layout.micro:
            stream.abandon()
            position = stream.state_dict()
            position.pop("samples", None)
            position["epoch"], position["batches_in_epoch"] = start[0], start[1]
            stream.load_state_dict(position)
            return
        self._switch(t, s, start, agreed, "the ranks agreed on the largest size they all fit")

    def _search(self, t: Trainer, s: TrainingState, batch: object, micro: int) -> tuple[int, str]:
        """The largest micro-batch from ``micro`` down that every rank fits (0: none) and
        this rank's last out-of-memory message."""
        assert s.distributed is not None  # several ranks
        device = s.distributed.collective_device
        if self._fsdp is not None:
            from speedtronic.engine.oom_probe import fsdp_probe

            _agree_on_gather_room(s.model, s.device, device)
            return fsdp_probe(
                self._fsdp,
                micro,
                t.settings.reshard_after_forward,
                lambda size: _try(t, s, batch, size),
                _smaller,
                device,
            )
        # DDP: each rank tries alone with the bare model (no collective), then one MIN.
        error = _try(t, s, batch, micro)
        while error and micro > 1:
            micro = _smaller(micro)
            error = _try(t, s, batch, micro)
        fits = torch.tensor([micro if not error else 0], dtype=torch.int64, device=device)
        dist.all_reduce(fits, op=dist.ReduceOp.MIN)
        return int(fits.item()), error


def _try(t: Trainer, s: TrainingState, batch: object, micro: int) -> str:
    """Forward/backward of the first ``micro`` samples of ``batch``; the out-of-memory
    message ("" when it fit). The gradients are dropped either way."""
    error = ""
    try:
        with t.forward_path.autocast():
            head = _head(batch, micro)
            loss = resolve_loss(run_model(s.model, head), head)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        del loss, head
    except torch.OutOfMemoryError as exc:
        error = str(exc)
    s.optimizer.zero_grad(set_to_none=True)
    if error and s.device.type == "cuda":
        torch.cuda.empty_cache()
    return error


def _probe_root(trainer: Trainer, state: TrainingState) -> FSDPModule:
    """The FSDP root whose first step ``engine.oom_probe`` searches; refuses what it cannot
    search (tensor parallelism, whose layers run collectives of their own; an FSDP2 without
    ``reset_iter_state``)."""
    # FSDP's modules load on first use, not with the trainer.
    from torch.distributed.fsdp import FSDPModule

    from speedtronic.engine.oom_probe import fsdp_can_probe

    world = state.distributed.world_size if state.distributed is not None else 1
    settings = trainer.settings
    root = state.model
    why = ""
    if settings.parallel != "fsdp" or not isinstance(root, FSDPModule):
        why = "its collectives run inside every forward and backward"
    elif settings.tensor > 1:
        why = (
            f"tensor parallelism (parallel.tensor {settings.tensor}) runs collectives inside "
            "every layer's forward and backward"
        )
    elif not fsdp_can_probe():
        why = f"this torch ({torch.__version__}) has no FSDPModule.reset_iter_state"
    if why:
        raise MicroBatchError(
            "data.micro_batch_size: auto cannot run with parallel.strategy "
            f"{settings.parallel} on {world} ranks: {why}, so a rank that runs out of memory "
            "leaves the others waiting in a collective and the ranks cannot agree on a smaller "
            "size; set an integer data.micro_batch_size (auto on one process finds one), or "
            "use parallel.strategy ddp"
        )
    assert isinstance(root, FSDPModule)  # checked above
    return root


def _agree_on_gather_room(model: nn.Module, device: torch.device, collective: torch.device) -> None:
    """Every rank can gather the whole model for the FSDP search (one MIN all-reduce)."""
    from speedtronic.engine.oom_probe import gather_room

    room = gather_room(model, device)
    fits = torch.tensor([0 if room else 1], dtype=torch.int64, device=collective)
    dist.all_reduce(fits, op=dist.ReduceOp.MIN)
    if not int(fits.item()):
        where = room or "another rank (its log names the device and the sizes)"
        raise MicroBatchError(
            "data.micro_batch_size: auto under parallel.strategy fsdp gathers every parameter "
            f"for its first-step search, and they do not fit in the memory of {where}; set an "
            "integer data.micro_batch_size"
        )


def _fsdp_mid_run_text(layout: BatchLayout | None, error: str) -> str:
    """Why an OOM after the first step ends an FSDP run of several ranks."""
    micro = layout.micro if layout is not None else 0
    smaller = f" of {_smaller(micro)} or less" if micro > 1 else ""
    return (
        f"data.micro_batch_size: auto: out of memory after the first step under "
        f"parallel.strategy fsdp on several ranks (micro-batch {micro}): the other ranks are "
        "inside FSDP's all-gather or reduce-scatter, so the step cannot be run again at a "
        "smaller size; resume from the last checkpoint with an integer "
        f"data.micro_batch_size{smaller} and the same target_batch_size ({error})"
    )


def auto_resume_layout(trainer: Trainer, state: Mapping[str, object]) -> BatchLayout | None:
    """The layout a checkpoint of an ``auto`` run chose, to resume with on the same ranks
    (None when it keeps the trainer's, or changes the global batch)."""
    saved, current = saved_layout(state), current_layout(trainer)
    if saved is None or current is None or saved == current:
        return None
    if saved.ranks != current.ranks or saved.global_batch != current.global_batch:
        return None
    logger.info("data.micro_batch_size auto: resumed with the checkpoint's %s", saved.describe())
    return saved
