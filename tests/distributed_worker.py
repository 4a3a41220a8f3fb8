"""One rank of a distributed test run, started by ``tests/test_distributed.py``.

The tests fork each rank from the preloaded fork server (``tests/forked.py``) and call
``run_rank`` there with the torchrun variables set; by hand it runs as a script::

    RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python tests/distributed_worker.py <scenario> <out_dir> '<json params>'

It reads the torchrun environment like any speedtronic run, plays one scenario and writes
what the test checks to ``<out_dir>/rank<r>.json`` (and tensors to ``rank<r>.pt``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from speedtronic import Trainer  # noqa: E402
from speedtronic.config import SpeedtronicConfig  # noqa: E402
from speedtronic.data import build_dataloader  # noqa: E402
from speedtronic.engine.callback import Callback  # noqa: E402
from speedtronic.engine.contexts import StepContext  # noqa: E402
from speedtronic.engine.result import TrainResult  # noqa: E402
from speedtronic.models.registry import build_model  # noqa: E402
from speedtronic.runtime import build_runtime  # noqa: E402
from speedtronic.state.rng import seed_everything  # noqa: E402
from speedtronic.systems.distributed import setup_distributed  # noqa: E402
from speedtronic_callbacks.diloco.collective import CollectiveDiLoCo  # noqa: E402

torch.set_num_threads(1)


def base_config(output_dir: Path, **sections: Mapping[str, object]) -> dict[str, object]:
    """A tiny reference-transformer run on the learnable synthetic language."""
    config: dict[str, dict[str, object]] = {
        "run": {"seed": 7, "device": "cpu", "max_steps": 8, "output_dir": str(output_dir)},
        "model": {
            "name": "reference_transformer",
            "vocab_size": 32,
            "max_seq_len": 16,
            "n_layer": 1,
            "n_head": 2,
            "d_model": 32,
            "d_ff": 64,
        },
        "data": {
            "synthetic": True,
            "synthetic_kind": "learnable",
            "num_tokens": 256,
            "micro_batch_size": 2,
            "target_batch_size": 4,
            "shuffle": True,
        },
        "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.0, "grad_clip": 1.0},
        "logging": {"every_steps": 1, "console": False, "jsonl": True},
        "checkpoint": {"enabled": True, "every_steps": 4, "keep_last": None},
        "distributed": {"timeout_s": 30.0},
    }
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    return dict(config)


def losses(result: TrainResult) -> dict[str, float]:
    return {str(record["step"]): float(record["loss"]) for record in result.metrics}


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in trainer.model.state_dict().items()}


def fit(config: Mapping[str, object], **runtime: object) -> tuple[Trainer, TrainResult]:
    trainer, _ = build_runtime(dict(config), **runtime)  # type: ignore[arg-type]  # test helper
    return trainer, trainer.fit()


# -- scenarios ------------------------------------------------------------------------------


DDP_EVAL = {"every_steps": 3}
"""Evaluation in the ddp scenario: steps 3 and 6, and the final step of each fit."""


def eval_losses(result: TrainResult) -> dict[str, float]:
    return {str(r["step"]): float(r["eval/loss"]) for r in result.metrics if "eval/loss" in r}


def global_eval_losses(result: TrainResult) -> dict[str, float]:
    key = "diloco/eval_global/loss"
    return {str(r["step"]): float(r[key]) for r in result.metrics if key in r}


def ddp(out: Path, rank: int, params: Mapping[str, object]) -> dict[str, object]:
    """8 steps in one go, then 4 + resume to 8; metrics files written once; evaluation on
    (each rank evaluates its share of the held-out set, the sums are all-reduced)."""
    full_trainer, full = fit(base_config(out / "full", eval=DDP_EVAL))
    fit(base_config(out / "part", run={"max_steps": 4}, eval=DDP_EVAL))
    resumed_trainer, resumed = fit(base_config(out / "part", eval=DDP_EVAL), resume=True)
    torch.save(
        {"full": weights(full_trainer), "resumed": weights(resumed_trainer)}, out / f"rank{rank}.pt"
    )
    return {
        "full": losses(full),
        "resumed": losses(resumed),
        "full_eval": eval_losses(full),
        "resumed_eval": eval_losses(resumed),
        "final_loss": full.final_loss,
        "samples": full.samples,
        "tokens": full.tokens,
    }


class _SGDRun:
    """A run built by hand: SGD without momentum, optionally with synchronous DiLoCo."""

    def __init__(self, out: Path, diloco: CollectiveDiLoCo | None, steps: int) -> None:
        config = SpeedtronicConfig.from_dict(
            base_config(
                out,
                checkpoint={"enabled": False},
                logging={"jsonl": False},
                optimizer={"grad_clip": None},  # clipping per replica is not linear
            )
        )
        distributed = setup_distributed("cpu", timeout_s=30.0)
        assert distributed is not None
        seed_everything(config.run.seed)
        model = build_model(config.model)
        loader = build_dataloader(
            config.data, rank=distributed.rank, world_size=distributed.world_size
        )
        callbacks: list[Callback] = [diloco] if diloco is not None else []
        self.trainer = Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.05),
            loader,
            config=config,
            callbacks=callbacks,
            distributed=distributed,
            max_steps=steps,
        )
        self.result = self.trainer.fit()


def diloco_equivalence(out: Path, rank: int, params: Mapping[str, object]) -> dict[str, object]:
    """H=1, outer lr 1, momentum 0 versus DDP, both with plain SGD; then bf16 byte counts."""
    steps = int(str(params.get("steps", 5)))
    per_replica = int(str(params.get("ranks_per_replica", 1)))
    plain = _SGDRun(out / "ddp", None, steps)
    one_step = CollectiveDiLoCo(
        inner_steps=1, outer_lr=1.0, outer_momentum=0.0, ranks_per_replica=per_replica
    )
    diloco = _SGDRun(out / "diloco", one_step, steps)
    bf16 = CollectiveDiLoCo(inner_steps=2, compression="bf16", ranks_per_replica=per_replica)
    _SGDRun(out / "bf16", bf16, 4)
    saved = {"ddp": weights(plain.trainer), "diloco": weights(diloco.trainer)}
    extra: dict[str, object] = {}
    if per_replica == 1:  # fp4's all-gather, on 2 ranks only (keeps the 4-rank case fast)
        fp4 = CollectiveDiLoCo(inner_steps=2, delta_dtype="fp4")
        saved["fp4"] = weights(_SGDRun(out / "fp4", fp4, 4).trainer)
        extra = {"fp4_bytes": fp4.bytes_reduced, "fp4_outer_steps": fp4.outer_steps}
    torch.save(saved, out / f"rank{rank}.pt")
    return {
        "ddp": losses(plain.result),
        "diloco": losses(diloco.result),
        "ddp_wrapped": plain.trainer.train_module is not plain.trainer.model,
        "diloco_wrapped": diloco.trainer.train_module is not diloco.trainer.model,
        "outer_steps": one_step.outer_steps,
        "bf16_bytes": bf16.bytes_reduced,
        "synced_numel": sum(p.numel() for p in plain.trainer.model.parameters()),
        **extra,
    }


def diloco_resume(out: Path, rank: int, params: Mapping[str, object]) -> dict[str, object]:
    """H=4 on 2 ranks: ``steps`` steps in one go versus ``steps - 4`` + resume; then a
    resume from the middle of a round (checkpoint at step 6). Evaluation every 4 steps
    (right after each outer round): the global model's held-out loss, reduced over ranks."""
    steps = int(str(params["steps"]))

    def run(
        directory: str, max_steps: int, resume: bool = False, every: int = 4
    ) -> tuple[Trainer, TrainResult]:
        config = base_config(
            out / directory,
            run={"max_steps": max_steps},
            optimizer={"lr": 1e-2},
            checkpoint={"every_steps": every},
            eval={"every_steps": 4},
        )
        callback = CollectiveDiLoCo(inner_steps=4, outer_lr=0.7, outer_momentum=0.5)
        return fit(config, resume=resume, extra_callbacks=[callback])

    full_trainer, full = run("full", steps)
    run("part", steps - 4)
    resumed_trainer, resumed = run("part", steps, resume=True)
    run("mid", 6, every=6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run("mid", 8, resume=True, every=6)
    diloco = next(cb for cb in full_trainer.callbacks if isinstance(cb, CollectiveDiLoCo))
    torch.save(
        {"full": weights(full_trainer), "resumed": weights(resumed_trainer)}, out / f"rank{rank}.pt"
    )
    return {
        "full": losses(full),
        "resumed": losses(resumed),
        "outer_steps": diloco.outer_steps,
        "local_eval": eval_losses(full),
        "global_eval": global_eval_losses(full),
        "resumed_global_eval": global_eval_losses(resumed),
        "warnings": [str(w.message) for w in caught if "diloco" in str(w.message)],
    }


class _Misbehave(Callback):
    """Rank ``rank`` dies (or hangs) at the start of step ``step``."""

    def __init__(self, rank: int, step: int, action: Callable[[], None]) -> None:
        self.rank, self.step, self.action = rank, step, action

    def on_step_start(self, trainer: Trainer, ctx: StepContext) -> None:
        distributed = trainer.distributed
        if distributed is not None and distributed.rank == self.rank and ctx.step == self.step:
            self.action()


def _die() -> None:
    os._exit(17)


def _hang() -> None:
    time.sleep(600)


def failure(out: Path, rank: int, params: Mapping[str, object]) -> dict[str, object]:
    """Rank 1 dies or hangs at step 3; the others must fail with a clear error."""
    action = _die if params["how"] == "die" else _hang
    config = base_config(
        out,
        distributed={"timeout_s": float(str(params["timeout_s"]))},
        checkpoint={"enabled": False},
        run={"max_steps": 50},
    )
    started = time.monotonic()
    try:
        fit(config, extra_callbacks=[_Misbehave(1, 3, action)])
    except Exception as exc:  # what the test checks
        return {
            "error": f"{type(exc).__name__}: {exc}",
            "seconds": time.monotonic() - started,
        }
    return {"error": None, "seconds": time.monotonic() - started}


class _SlowSteps(Callback):
    """Makes every step take at least 20 ms (a wall-clock run that does a few dozen)."""

    def on_step_start(self, trainer: Trainer, ctx: StepContext) -> None:
        time.sleep(0.02)


def wall_clock(out: Path, rank: int, params: Mapping[str, object]) -> dict[str, object]:
    """A 3 s time budget and saves every second (tests/test_time_budget.py)."""
    from speedtronic.state.checkpoint import checkpoint_step
    from speedtronic_callbacks.checkpoint import CheckpointCallback
    from speedtronic_callbacks.time_budget import TimeBudget

    config = base_config(
        out / "run",
        run={"max_steps": 10**6, "max_time": "3s"},
        logging={"every_steps": 5},
        checkpoint={"every_steps": 10**6, "every_minutes": 1 / 60},
    )
    config["callbacks"] = [{"name": "checkpoint", "save_final": False}]
    trainer, _ = build_runtime(config, extra_callbacks=[_SlowSteps()])  # type: ignore[arg-type]
    result = trainer.fit()
    budget = next(c for c in trainer.callbacks if isinstance(c, TimeBudget))
    checkpoint = next(c for c in trainer.callbacks if isinstance(c, CheckpointCallback))
    assert checkpoint.wall_clock is not None
    return {
        "steps": result.steps,
        "stop_reason": result.stop_reason,
        "saved": [checkpoint_step(p.name) for p in checkpoint.manager.checkpoint_paths()],
        "budget_decisions": budget.clock.decisions,
        "save_decisions": checkpoint.wall_clock.decisions,
    }


def remote_resume(out: Path, rank: int, params: Mapping[str, object]) -> dict[str, object]:
    """8 steps in one go; 4 steps mirrored to a ``file://`` store, then a resume to 8 in an
    empty directory that only the store can fill (tests/test_remote_checkpoint.py)."""
    store = {"remote": (out / "store").as_uri()}
    full_trainer, full = fit(base_config(out / "full"))
    fit(base_config(out / "a", run={"max_steps": 4}, checkpoint=store))
    resumed_trainer, resumed = fit(base_config(out / "b", checkpoint=store), resume=True)
    point = resumed_trainer.resumed_from
    full_weights, resumed_weights = weights(full_trainer), weights(resumed_trainer)
    return {
        "full": losses(full),
        "resumed": losses(resumed),
        "resumed_from": None if point is None else point.path.name,
        "same_weights": all(torch.equal(full_weights[k], resumed_weights[k]) for k in full_weights),
    }


SCENARIOS: dict[str, Callable[[Path, int, Mapping[str, object]], dict[str, object]]] = {
    "ddp": ddp,
    "remote_resume": remote_resume,
    "wall_clock": wall_clock,
    "diloco_equivalence": diloco_equivalence,
    "diloco_resume": diloco_resume,
    "failure": failure,
}


def run_rank(scenario: str, out: str, raw: str) -> int:
    """This process's rank (from the torchrun environment) plays ``scenario``; the exit code."""
    out_dir = Path(out)
    rank = int(os.environ["RANK"])
    out_dir.mkdir(parents=True, exist_ok=True)
    report = SCENARIOS[scenario](out_dir, rank, json.loads(raw))
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report), encoding="utf-8")
    return 1 if report.get("error") else 0


if __name__ == "__main__":
    raise SystemExit(run_rank(sys.argv[1], sys.argv[2], sys.argv[3]))
