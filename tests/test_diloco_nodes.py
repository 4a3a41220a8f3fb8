"""DiLoCo nodes that are torchrun jobs: hub-mode workers whose node is a 2-rank gloo job (DDP
inside the node, rank 0 talks to a directory hub and broadcasts every install), with a
single-process master. Every process is forked from the preloaded fork server
(tests/forked.py); the worker ranks get the torchrun variables. Worker code:
tests/diloco_node_worker.py."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from diloco_node_worker import node, run_config
from forked import Child, Forked
from test_distributed import free_port, rank_env

from speedtronic.config import SpeedtronicConfig
from speedtronic.data.held_out import build_eval_loader
from speedtronic.engine.evaluation import evaluate_model
from speedtronic.models.registry import build_model
from speedtronic_callbacks.diloco.model_layout import build_layout
from speedtronic_callbacks.diloco.pointer import POINTER_PATH, decode_pointer
from speedtronic_callbacks.diloco.wire import decode_global

STEPS = 40  # per node: 4 outer rounds of inner_steps=10 (the kill-and-resume test)
LEARNING_STEPS = 120  # per node: 6 outer rounds of inner_steps=20 (the held-out loss test)


def start_node(
    forked: Forked, out: Path, tag: str, index: int, steps: int = STEPS, **params: object
) -> list[Child]:
    """A worker node: two ranks of one torch.distributed job."""
    port = free_port()
    payload = json.dumps({"kind": "worker", "tag": tag, "index": index, "steps": steps, **params})
    return [forked.start(node, str(out), payload, env=rank_env(r, 2, port)) for r in (0, 1)]


def start_master(
    forked: Forked, out: Path, wait_for: Sequence[str], steps: int = STEPS, **params: object
) -> Child:
    payload = {
        "kind": "master",
        "tag": "master",
        "steps": steps,
        "wait_for": list(wait_for),
        "deadline": max(60, steps),
        **params,
    }
    return forked.start(node, str(out), json.dumps(payload), env={"RANK": None})


def report(out: Path, tag: str, rank: int = 0) -> dict[str, object]:
    loaded: dict[str, object] = json.loads((out / f"{tag}-rank{rank}.json").read_text())
    return loaded


def finished(children: Sequence[Child], timeout: float = 60) -> None:
    for child in children:
        assert child.wait(timeout=timeout) == 0, child.output[-4000:]


def weights(out: Path, tag: str, rank: int) -> dict[str, torch.Tensor]:
    loaded: dict[str, torch.Tensor] = torch.load(out / f"{tag}-rank{rank}.pt", weights_only=True)
    return loaded


def held_out_loss(out: Path, state: Mapping[str, torch.Tensor]) -> float:
    config = SpeedtronicConfig.from_dict(run_config(out / "eval", STEPS))
    model = build_model(config.model)
    layout = build_layout(model.state_dict())
    full = dict(state)
    for alias, source in layout.aliases.items():
        full.setdefault(alias, state[source])
    model.load_state_dict(full)
    loader = build_eval_loader(config.data, config.eval, vocab_size=config.data.vocab_size)
    outcome = evaluate_model(model, loader, device=torch.device("cpu"), max_batches=16)
    return float(outcome.metrics["eval/loss"])


def hub_global(out: Path) -> dict[str, torch.Tensor]:
    config = SpeedtronicConfig.from_dict(run_config(out / "eval", STEPS))
    layout = build_layout(build_model(config.model).state_dict())
    data = (out / "hub" / POINTER_PATH).read_bytes()
    fingerprint = json.loads(data)["fingerprint"]  # the layout's, with the run's config
    pointer = decode_pointer(data, fingerprint=fingerprint, secret=None)
    layout = dataclasses.replace(layout, fingerprint=fingerprint)
    return decode_global((out / "hub" / pointer.model_file).read_bytes(), layout, secret=None)


def assert_ranks_agree(out: Path, tag: str) -> None:
    first, second = weights(out, tag, 0), weights(out, tag, 1)
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), (tag, key)


def test_master_and_two_multi_rank_worker_nodes_train_like_one_node(
    tmp_path: Path, forked: Forked
) -> None:
    started = time.monotonic()
    steps, cheap = LEARNING_STEPS, {"checkpoints": False, "log_every": 40, "inner_steps": 20}
    master = start_master(forked, tmp_path, ["w1", "w2"], steps, **cheap)
    ranks = start_node(forked, tmp_path, "w1", 1, steps, **cheap)
    ranks += start_node(forked, tmp_path, "w2", 2, steps, **cheap)
    single = {"kind": "single", "tag": "single", "steps": steps, **cheap}
    reference_run = forked.start(node, str(tmp_path), json.dumps(single))
    finished([*ranks, reference_run, master], timeout=150)
    seconds = time.monotonic() - started

    for tag in ("w1", "w2"):
        assert_ranks_agree(tmp_path, tag)  # every install reached both ranks, at one step
        outcome = report(tmp_path, tag)
        assert outcome["steps"] == steps
        assert int(outcome["uploads"]) >= 3  # type: ignore[call-overload]  # JSON int
        assert int(outcome["installs"]) >= 2  # type: ignore[call-overload]  # JSON int
        assert "uploads" not in report(tmp_path, tag, 1)  # only rank 0 talks to the hub
    assert report(tmp_path, "master")["stop_reason"] == "workers finished"

    diloco = held_out_loss(tmp_path, hub_global(tmp_path))
    reference = held_out_loss(tmp_path, weights(tmp_path, "single", 0))
    untrained = held_out_loss(
        tmp_path,
        build_model(
            SpeedtronicConfig.from_dict(run_config(tmp_path / "eval", STEPS)).model
        ).state_dict(),
    )
    print(
        f"held-out loss: diloco {diloco:.4f}, single node {reference:.4f}, "
        f"untrained {untrained:.4f} ({seconds:.1f} s)"
    )
    assert diloco < untrained - 1.0  # the nodes learned the language together
    # Issue 13: within 5% of a single node of the same total budget (120 steps x 24
    # samples, H = 20). Measured 1.269-1.291 against 1.261 in 15 runs (ratio 1.006-1.024;
    # the rounds' timing varies. With H = 10: 0.997-1.045, docs/scale-out.md).
    # Before the hub-mode delta-carry rule (a node installing a global dropped its unsent
    # progress from its weights) it was 1.6-1.9 against 1.44 at 40 steps.
    assert diloco <= reference * 1.05


def test_a_killed_rank_ends_its_node_and_the_node_resumes_and_rejoins(
    tmp_path: Path, forked: Forked
) -> None:
    master = start_master(forked, tmp_path, ["w1"])
    started = time.monotonic()
    first = start_node(forked, tmp_path, "w1", 1, die_at=17)
    assert first[1].wait(timeout=60) == 17  # rank 1 was killed at step 17
    assert first[0].wait(timeout=60) == 1, first[0].output[-4000:]
    assert time.monotonic() - started < 40  # the job's collective timeout, not a hang
    error = report(tmp_path, "w1")["error"]
    assert isinstance(error, str) and "CollectiveError" in error, error

    resumed = start_node(forked, tmp_path, "w1", 1, resume=True)
    finished([*resumed, master], timeout=90)
    assert_ranks_agree(tmp_path, "w1")
    outcome = report(tmp_path, "w1")
    records = outcome["records"]
    assert isinstance(records, list)
    assert records[0]["step"] == 16  # resumed from its last checkpoint (step 15)
    assert int(outcome["uploads"]) >= 2  # type: ignore[call-overload]  # JSON int
    assert int(outcome["installs"]) >= 1  # type: ignore[call-overload]  # JSON int


def _applied(audit: Path, node: str, kind: str = "applied") -> list[dict[str, object]]:
    """The deltas of ``node`` that the master's audit log says it applied (or rejected)."""
    if not audit.exists():
        return []
    records = [json.loads(line) for line in audit.read_text().splitlines() if line]
    return [
        item
        for r in records
        for item in r[kind]
        if item.get("node_id") == node or str(item.get("path", "")).startswith(f"nodes/{node}/")
    ]


def test_a_worker_killed_after_uploading_resumes_from_an_older_checkpoint_sending_nothing_twice(
    tmp_path: Path, forked: Forked
) -> None:
    # Issue 22 item 9: a worker uploads its deltas of steps 45 and 50, is SIGKILLed, and is
    # resumed from its step-40 checkpoint: it recomputes steps 41..50, whose progress and
    # tokens the hub already has, and must send neither again.
    cheap = {"inner_steps": 5, "checkpoint_every": 40, "log_every": 60}
    master = start_master(forked, tmp_path, ["w1"], 60, **cheap)
    worker = {"kind": "worker", "tag": "w1", "index": 1, "steps": 60, "micro_batch": 8, **cheap}
    worker["pace"] = 0.05  # steps slower than uploads and polls, as on a real model
    killed = {**worker, "hold_after": 50}
    first = forked.start(node, str(tmp_path), json.dumps(killed), env={"RANK": None})
    held, audit = tmp_path / "w1.held", tmp_path / "master" / "diloco" / "rounds-master.jsonl"
    deadline = time.monotonic() + 90
    while not held.exists():
        assert first.poll() is None, first.output[-3000:]
        assert time.monotonic() < deadline, "the worker never reached step 50"
        time.sleep(0.05)
    sent = int(json.loads(held.read_text())["sent_through"])
    assert sent > 40  # uploads made after the checkpoint (45 and 50 unless one was skipped)
    while not any(item["local_step"] == sent for item in _applied(audit, "w1")):
        assert master.poll() is None, master.output[-3000:]
        assert time.monotonic() < deadline, f"the master never applied w1's step {sent}"
        time.sleep(0.05)
    first.kill()  # SIGKILL: no final checkpoint; the newest is step 40's

    again = {**worker, "resume": True, "log_every": 1}
    resumed = forked.start(node, str(tmp_path), json.dumps(again), env={"RANK": None})
    finished([resumed, master], timeout=90)

    outcome = report(tmp_path, "w1")
    records = outcome["records"]
    assert isinstance(records, list) and records[0]["step"] == 41  # from the step-40 checkpoint
    assert records[-1]["diloco/resyncs"] == 1  # it dropped work the hub already had ...
    assert _applied(audit, "w1", "rejected") == []  # ... and sent none of it again
    applied = _applied(audit, "w1")
    ranges = sorted((int(str(i["first_step"])), int(str(i["local_step"]))) for i in applied)
    # From its first install (step 0 or 1; later when the hub had moved on from the weights
    # the node started with, whose progress then does not count) to its last upload (step
    # 60, or 55 when the upload of 55 was still running at step 60):
    first, last = ranges[0][0], ranges[-1][1]
    assert first < 40 and last > sent, ranges  # the resumed run sent new work
    for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False):
        assert start == end, ranges  # every step's progress in exactly one applied delta
    per_step = int(str(outcome["tokens"])) // 60
    tokens = sum(int(str(item["tokens"])) for item in applied)
    assert tokens == per_step * (last - first)  # every step's tokens counted once
