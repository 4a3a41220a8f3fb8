"""What a checkpoint of a training state holds, and how it is captured and restored.

``capture_training_state`` returns everything needed to continue a run exactly from a
``TrainingState`` (``speedtronic.engine.state``) -- model,
optimizer, scheduler, grad scaler, counters, RNG, data position, every callback's state, the
redacted config, and which run wrote it (``run``: its id and run directory) -- as tensors and
plain data only (checkpoints load with
``weights_only=True``). ``restore_training_state`` checks the model first and loads the
optimizer before touching the weights, so a checkpoint that does not fit leaves the state as
it was and raises ``TrainingStateError`` naming what does not fit.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from speedtronic._version import __version__
from speedtronic.state.rng import capture_rng_state, restore_rng_state

# The checkpoint formats (sharded DCP tensors, the callbacks' shards, the run's identity) and
# the loading checks are imported by the functions that write or read a state: a Trainer
# loads this module for ``TrainingStateError`` and pays for them only at its first
# ``state_dict`` / ``load_state_dict``.

if TYPE_CHECKING:
    from collections.abc import Sequence

    from speedtronic.engine.callback import Callback
    from speedtronic.engine.state import TrainingState

__all__ = [
    "STATE_FORMAT_VERSION",
    "TrainingStateError",
    "callback_states",
    "capture_training_state",
    "restore_training_state",
]

STATE_FORMAT_VERSION = 1
"""Version of the layout returned by ``Trainer.state_dict`` (stored in checkpoints)."""


class TrainingStateError(ValueError):
    """A saved training state does not fit this trainer (format, model keys, shapes)."""


def callback_states(callbacks: Sequence[Callback]) -> dict[str, dict[str, object]]:
    """Every stateful callback's ``state_dict()``, by ``state_key``."""
    return {cb.state_key: cb.state_dict() for cb in callbacks if cb.state_key is not None}


def capture_training_state(training: TrainingState) -> dict[str, object]:
    """Everything needed to continue this run exactly (loads with weights_only=True)."""
    from speedtronic.state.callback_shards import CALLBACK_SHARD_PATHS, split_callback_shards
    from speedtronic.state.run_identity import RUN_STATE_KEY
    from speedtronic.state.sharded_checkpoint import (
        CALLBACK_SHARDS,
        SHARDED_MARKER,
        capture_sharded_tensors,
    )

    run_config = training.run_config
    config = copy.deepcopy(dict(run_config)) if run_config is not None else None
    callbacks = callback_states(training.callbacks)
    sharded_leaves: dict[str, object] = {}
    if training.sharded:  # this rank's shards, keyed by parameter name (they reshard)
        model, optimizer = capture_sharded_tensors(training.model, training.optimizer)
        callbacks, shards, paths = split_callback_shards(callbacks)
        if shards:  # a callback's own DTensor shards go through DCP as well
            sharded_leaves = {CALLBACK_SHARDS: shards, CALLBACK_SHARD_PATHS: paths}
    else:
        model, optimizer = training.model.state_dict(), training.optimizer.state_dict()
    counters: dict[str, int] = {
        "step": training.step,
        "samples": training.samples,
        "tokens": training.tokens,
        "world_size": _world(training)[1],  # the counters above are this rank's share
    }
    if training.tensor > 1:  # of its data rank's batches, which its tensor peers count too
        counters["tensor"] = training.tensor
    state: dict[str, object] = {
        "format_version": STATE_FORMAT_VERSION,
        "versions": {"speedtronic": __version__, "torch": str(torch.__version__)},
        "model": model,
        "optimizer": optimizer,
        "scheduler": training.scheduler.state_dict() if training.scheduler is not None else None,
        "scaler": training.scaler.state_dict() if training.scaler is not None else None,
        "counters": counters,
        "rng": capture_rng_state(),
        "data": training.stream.state_dict(),
        "callbacks": callbacks,
        "config": config,
        "precision": {
            "mode": training.precision.mode,
            "autocast_enabled": training.precision.autocast_enabled,
            "use_scaler": training.precision.use_scaler,
        },
    }
    if training.run_id is not None:  # which run wrote it (speedtronic.state.run_identity)
        state[RUN_STATE_KEY] = {"id": training.run_id, "output_dir": str(training.output_dir)}
    if training.sharded:
        state[SHARDED_MARKER] = True  # written as a sharded (DCP) checkpoint
        state.update(sharded_leaves)
    return state


def _load_optimizer(training: TrainingState, saved: dict[str, object]) -> None:
    """Load the optimizer's state; a group layout that differs from this run's is a
    ``TrainingStateError`` that says which setting decides the layout."""
    from speedtronic.state.optimizer_load import load_optimizer_state

    groups = saved.get("param_groups")
    ours = len(training.optimizer.param_groups)
    if isinstance(groups, list) and len(groups) != ours:
        raise TrainingStateError(
            f"the checkpoint's optimizer has {len(groups)} parameter group(s), this run's has "
            f"{ours}: the optimizer settings that split parameters into groups differ (e.g. "
            "optimizer.decay_norms_and_biases, whose default a callback may propose; set it "
            "as the run that wrote the checkpoint had it)"
        )
    load_optimizer_state(training.optimizer, saved)


def restore_training_state(
    training: TrainingState, state: Mapping[str, object], *, load_callbacks: bool = True
) -> None:
    """Restore a ``state_dict``; raises ``TrainingStateError`` naming what does not fit."""
    from speedtronic.state.callback_shards import with_callback_shards
    from speedtronic.state.sharded_checkpoint import SHARDED_DIRECTORY, load_sharded_tensors

    version = state.get("format_version")
    if version != STATE_FORMAT_VERSION:
        raise TrainingStateError(
            f"unknown training-state format version {version!r} "
            f"(this speedtronic reads version {STATE_FORMAT_VERSION})"
        )
    saved_callbacks = with_callback_shards(state, like=training.model) if load_callbacks else {}
    if isinstance(state.get(SHARDED_DIRECTORY), str):
        # A sharded checkpoint: its tensors load (and reshard) from its directory, checked
        # against the model before anything changes (the callbacks' shards, above, load
        # into fresh tensors).
        directory = Path(str(state[SHARDED_DIRECTORY]))
        load_sharded_tensors(directory, training.model, training.optimizer)
    elif training.sharded:
        raise TrainingStateError(
            "this run shards its model (parallel.strategy fsdp) and resumes from sharded "
            "checkpoints (step_*.dcp directories) only; this one is a single file written by "
            "a ddp or single-process run: resume it with parallel.strategy ddp"
        )
    else:
        # Check the model first and load the optimizer (which validates its groups) before
        # touching the weights, so a mismatched checkpoint leaves the trainer as it was.
        weights = cast(Mapping[str, torch.Tensor], state["model"])
        _check_model(training, weights)
        _load_optimizer(training, cast(dict[str, object], state["optimizer"]))
        training.model.load_state_dict(weights)
    if training.scheduler is not None and state.get("scheduler") is not None:
        training.scheduler.load_state_dict(cast(dict[str, object], state["scheduler"]))
    if training.scaler is not None and state.get("scaler") is not None:
        training.scaler.load_state_dict(cast(dict[str, object], state["scaler"]))
    counters = cast(Mapping[str, int], state["counters"])
    training.step = int(counters["step"])
    training.samples, training.tokens = _rank_share(training, counters)
    restore_rng_state(cast(Mapping[str, object] | None, state.get("rng")))
    _adopt_saved_cuda_rng(training, state.get("rng"))
    data_state = state.get("data")
    if isinstance(data_state, Mapping):
        training.stream.load_state_dict(cast(Mapping[str, int], data_state))
    if load_callbacks:
        _load_callback_states(training, saved_callbacks)


def _world(training: TrainingState) -> tuple[int, int]:
    """This process's rank and the world size (0 and 1 without a process group)."""
    distributed = training.distributed
    return (distributed.rank, distributed.world_size) if distributed is not None else (0, 1)


def _rank_share(training: TrainingState, counters: Mapping[str, int]) -> tuple[int, int]:
    """This rank's share of the saved sample and token counters.

    Each rank counts what it trained; the ranks of a tensor-parallel group (``tensor``, the
    ranks ``d * T .. d * T + T - 1`` of data rank ``d``) train the same batches and count
    them alike, so the run's totals are the sum over ranks divided by ``T``. A checkpoint
    holds rank 0's counts, the world size and ``T``. In the same layout every rank's counts
    equal rank 0's (every data rank sees as many samples), so they carry over as they are.
    In another layout the saved run's totals (rank 0's counts times its data-parallel
    degree, ``world_size / T``) are split over the new data ranks, the remainder to the
    lowest, each share counted by all ``T`` ranks of the data rank: the new run's totals
    continue from the old run's. States written before ``world_size`` was recorded carry
    over as they are; ``tensor`` is recorded when above 1 (absent: 1)."""
    samples, tokens = int(counters["samples"]), int(counters["tokens"])
    saved_world = int(counters.get("world_size", 0))
    saved_tensor = max(int(counters.get("tensor", 1)), 1)
    rank, world = _world(training)
    tensor = training.tensor if training.tensor > 0 and world % training.tensor == 0 else 1
    if saved_world == 0 or (saved_world, saved_tensor) == (world, tensor):
        return samples, tokens
    saved_data_ranks = max(saved_world // saved_tensor, 1)
    data_rank, data_ranks = rank // tensor, world // tensor

    def share(count: int) -> int:
        total = count * saved_data_ranks
        return total // data_ranks + (1 if data_rank < total % data_ranks else 0)

    return share(samples), share(tokens)


def _adopt_saved_cuda_rng(training: TrainingState, rng: object) -> None:
    """Rank 0 saved the generator of *its* GPU (index 0 on its node); every rank ran the
    same random ops on its own GPU, so that state is the one this rank's GPU needs."""
    if not training.multi_rank or training.device.type != "cuda" or not isinstance(rng, Mapping):
        return
    saved = rng.get("cuda")
    if isinstance(saved, list) and saved and isinstance(saved[0], torch.Tensor):
        torch.cuda.set_rng_state(saved[0], training.device)


def _check_model(training: TrainingState, weights: Mapping[str, torch.Tensor]) -> None:
    from speedtronic.state.model_fit import model_mismatch, tensor_shapes

    problem = model_mismatch(tensor_shapes(training.model.state_dict()), tensor_shapes(weights))
    if problem is not None:
        raise TrainingStateError(problem)


def _load_callback_states(
    training: TrainingState, states: Mapping[str, Mapping[str, object]]
) -> None:
    known = {cb.state_key: cb for cb in training.callbacks if cb.state_key is not None}
    for key, callback in known.items():
        if key in states:
            callback.load_state_dict(states[key])
        else:
            warnings.warn(
                f"checkpoint has no state for callback {callback.display_name!r} "
                f"(state_key {key!r}); it starts fresh",
                UserWarning,
                stacklevel=3,
            )
    for key in sorted(set(states) - set(known)):
        warnings.warn(
            f"checkpoint holds state for state_key {key!r} but no callback of this run "
            "uses that key; it is ignored",
            UserWarning,
            stacklevel=3,
        )
