"""Processes of ``tests/test_diloco_nodes.py``: a hub-mode DiLoCo master, worker nodes that
are multi-rank torch.distributed jobs (each rank forked from the preloaded fork server with
the torchrun variables set), and a single-node reference run. Each writes what the test
checks to ``<out>/<tag>-rank<r>.json`` and its final weights to ``<out>/<tag>-rank<r>.pt``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from distributed_worker import base_config

from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import OptimizerStepContext, StepContext
from speedtronic.engine.trainer import Trainer
from speedtronic.runtime import build_runtime
from speedtronic_callbacks.diloco import DiLoCoCallback

torch.set_num_threads(1)

SAMPLES_PER_NODE_STEP = 8
NODES = 3  # the master and two workers
INNER_STEPS = 10


def run_config(out: Path, steps: int, **sections: Mapping[str, object]) -> dict[str, object]:
    """The tiny language-model run every process trains (2048 samples of 16 tokens)."""
    config = base_config(
        out,
        run={"max_steps": steps, "seed": 7},
        data={"num_tokens": 16 * 2048, "micro_batch_size": 8, "target_batch_size": None},
        optimizer={"lr": 1e-2},
        scheduler={"name": "constant", "warmup_steps": 0},
        checkpoint={"enabled": True, "every_steps": 5, "keep_last": 2},
        distributed={"timeout_s": 10.0},
    )
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}  # type: ignore[dict-item]  # test helper
    return config


def diloco_options(
    hub: Path, role: str, node: str, index: int, inner_steps: int = INNER_STEPS
) -> dict[str, object]:
    return {
        "name": "diloco",
        "role": role,
        "node_id": node,
        "hub_dir": str(hub),
        "inner_steps": inner_steps,
        "node_index": index,
        "num_nodes": NODES,
        "poll_interval": 0.05,
        "retry_initial": 0.01,
        "retry_max": 0.1,
        # Asynchronous rounds of one delta each: each counts outer_lr x its staleness weight
        # (0.5 x ~0.7, about 1/3 with three nodes, so the global moves by about the nodes'
        # mean progress); no outer momentum to amplify them, and no optimizer reset at every
        # install (a few steps apart at this scale). See docs/scale-out.md.
        "outer_lr": 0.5,
        "outer_momentum": 0.0,
        "reset_optimizer": False,
    }


class _Die(Callback):
    """This rank dies at the start of step ``step`` (a killed rank)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_start(self, trainer: Trainer, ctx: StepContext) -> None:
        if ctx.step == self.step:
            os._exit(17)


class _Pace(Callback):
    """Each step takes ``pace`` seconds more, so that uploads and polls keep up."""

    def __init__(self, pace: float) -> None:
        self.pace = pace

    def on_step_end(self, trainer: Trainer, ctx: StepContext) -> None:
        time.sleep(self.pace)


class _HoldAfter(Callback):
    """After step ``step`` -- once its uploads finished -- the process writes ``marker``
    (the last local step it sent) and waits to be killed: a SIGKILL after known uploads."""

    def __init__(self, step: int, marker: Path) -> None:
        self.step, self.marker = step, marker

    def on_step_start(self, trainer: Trainer, ctx: StepContext) -> None:
        if ctx.step != self.step + 1:
            return
        diloco = next(cb for cb in trainer.callbacks if isinstance(cb, DiLoCoCallback))
        node = diloco.node
        assert node is not None and node.wait_idle(30) and node.unconfirmed is None
        self.marker.write_text(json.dumps({"sent_through": node.unsent.dispatched_through}))
        time.sleep(3600)


class _MasterHold(Callback):
    """After ``budget`` steps the master stops training (its steps change nothing) but keeps
    aggregating until every worker in ``wait_for`` is done and its deltas were applied."""

    def __init__(self, hub: Path, budget: int, wait_for: list[str], deadline: float) -> None:
        self.hub, self.budget, self.wait_for = hub, budget, wait_for
        self.deadline = time.monotonic() + deadline

    def on_before_optimizer_step(self, trainer: Trainer, ctx: OptimizerStepContext) -> None:
        if ctx.step > self.budget:
            trainer.skip_update()
            time.sleep(0.02)

    def on_step_end(self, trainer: Trainer, ctx: StepContext) -> None:
        if time.monotonic() > self.deadline:
            trainer.request_stop("deadline")
        if ctx.step <= self.budget:
            return
        done = all((self.hub.parent / f"{name}.done").exists() for name in self.wait_for)
        pending = list((self.hub / "nodes").glob("*/*.safetensors")) if done else [None]
        diloco = next(cb for cb in trainer.callbacks if isinstance(cb, DiLoCoCallback))
        if not pending and diloco.node is not None and not diloco.node.master_lane.busy:
            trainer.request_stop("workers finished")


def _report(
    out: Path, tag: str, rank: int, report: Mapping[str, object], trainer: Trainer | None
) -> None:
    if trainer is not None:
        weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        torch.save(weights, out / f"{tag}-rank{rank}.pt")
    (out / f"{tag}-rank{rank}.json").write_text(json.dumps(report), encoding="utf-8")


def node(out_dir: str, raw: str) -> int:
    """One process: ``params["kind"]`` is ``master``, ``worker`` (one rank of a worker node)
    or ``single`` (the single-node reference run)."""
    params = json.loads(raw)
    out, kind, tag = Path(out_dir), params["kind"], params["tag"]
    hub = out / "hub"
    rank = int(os.environ.get("RANK", "0"))
    steps = int(params["steps"])
    # The kill-and-resume test needs checkpoints; the learning test does not write them
    # (three processes x every 5 steps is most of a cheap step's cost).
    checkpoint = {
        "enabled": bool(params.get("checkpoints", True)),
        "every_steps": int(params.get("checkpoint_every", 5)),
    }
    logging = {"every_steps": int(params.get("log_every", 1))}
    inner_steps = int(params.get("inner_steps", INNER_STEPS))
    extra: list[Callback] = []
    if kind == "single":
        config = run_config(
            out / tag,
            steps,
            # one micro-batch of all three nodes' samples per step (the same mean gradient
            # as accumulating three, in a third of the loop's steps)
            data={
                "micro_batch_size": NODES * SAMPLES_PER_NODE_STEP,
                "target_batch_size": NODES * SAMPLES_PER_NODE_STEP,
            },
            checkpoint=checkpoint,
            logging=logging,
        )
    elif kind == "master":
        config = run_config(out / tag, 100_000, checkpoint=checkpoint, logging=logging)
        config["callbacks"] = [diloco_options(hub, "master", tag, 0, inner_steps)]
        extra.append(_MasterHold(hub, steps, list(params["wait_for"]), params["deadline"]))
    else:
        micro_batch = int(params.get("micro_batch", SAMPLES_PER_NODE_STEP // 2))
        config = run_config(
            out / tag,
            steps,
            data={"micro_batch_size": micro_batch},
            checkpoint=checkpoint,
            logging=logging,
        )
        config["callbacks"] = [
            diloco_options(hub, "worker", tag, int(params["index"]), inner_steps)
        ]
        if params.get("die_at") is not None and rank == 1:
            extra.append(_Die(int(params["die_at"])))
        if params.get("hold_after") is not None:
            extra.append(_HoldAfter(int(params["hold_after"]), out / f"{tag}.held"))
        if params.get("pace"):
            extra.append(_Pace(float(params["pace"])))
    trainer: Trainer | None = None
    report: dict[str, object] = {"error": None}
    try:
        trainer, _ = build_runtime(config, resume=bool(params.get("resume")), extra_callbacks=extra)  # type: ignore[arg-type]  # test helper
        result = trainer.fit()
        report["steps"] = result.steps
        report["stop_reason"] = result.stop_reason
        report["tokens"] = trainer.tokens
        records = [
            {k: v for k, v in r.items() if k.startswith("diloco/") or k == "step"}
            for r in result.metrics
        ]
        report["records"] = records
        diloco = [cb for cb in trainer.callbacks if isinstance(cb, DiLoCoCallback)]
        if diloco and diloco[0].node is not None:
            report["uploads"] = diloco[0].node.stats.uploads
            report["installs"] = diloco[0].node.stats.installs
    except Exception as exc:  # what the test checks
        report["error"] = f"{type(exc).__name__}: {exc}"
    _report(out, tag, rank, report, trainer)
    if kind == "worker" and rank == 0 and report["error"] is None:
        (hub.parent / f"{tag}.done").write_text("ok", encoding="utf-8")
    return 1 if report["error"] else 0
