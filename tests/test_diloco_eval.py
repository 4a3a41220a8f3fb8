"""Evaluation under DiLoCo: every node reports its local model as ``eval/loss``; the hub
master also evaluates every new global model it installs (in one process on a directory
hub), and the collective mode labels evaluations that follow an outer round, under the
``diloco/eval_global/*`` keys."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Subset

from speedtronic import Trainer
from speedtronic.data import LearnableLanguageDataset
from speedtronic.engine.callback import Callback
from speedtronic.engine.evaluation import evaluate_model
from speedtronic.models.transformer import ReferenceTransformer
from speedtronic_callbacks.diloco import DiLoCoCallback
from speedtronic_callbacks.diloco.collective import CollectiveDiLoCo
from speedtronic_callbacks.diloco.eval_keys import (
    GLOBAL_EVAL_LOSS,
    GLOBAL_EVAL_OUTER_STEP,
    GLOBAL_EVAL_PPL,
)
from speedtronic_callbacks.diloco.model_layout import build_layout
from speedtronic_callbacks.diloco.pointer import model_file_name
from speedtronic_callbacks.diloco.wire import decode_global, expand_aliases
from speedtronic_callbacks.jsonl import JsonlCallback

VOCAB, BLOCK, INNER = 32, 16, 4


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def tiny_model() -> ReferenceTransformer:
    torch.manual_seed(0)  # every node starts from the same weights
    return ReferenceTransformer(vocab_size=VOCAB, block_size=BLOCK, n_layer=1, n_head=2, d_model=16)


def train_loader(shard: int) -> DataLoader[object]:
    dataset = LearnableLanguageDataset(num_samples=256, block_size=BLOCK, vocab_size=VOCAB, seed=7)
    return DataLoader(
        Subset(dataset, range(shard, len(dataset), 2)),
        batch_size=8,
        shuffle=True,
        generator=torch.Generator().manual_seed(shard),
    )


def held_out() -> list[object]:
    dataset = LearnableLanguageDataset(num_samples=16, block_size=BLOCK, vocab_size=VOCAB, seed=99)
    return list(DataLoader(dataset, batch_size=8))


def trainer_for(
    callbacks: list[Callback], output_dir: Path, shard: int = 0, *, evaluate: bool
) -> Trainer:
    """A node's trainer; metrics every step, so that a global evaluation lands in the
    record of its install step."""
    model = tiny_model()
    return Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        train_loader(shard),
        callbacks=callbacks,
        output_dir=output_dir,
        metrics_every=1,
        eval_data=held_out() if evaluate else None,
        eval_every=INNER if evaluate else None,
    )


def node(tmp_path: Path, role: str, name: str, shard: int) -> tuple[Trainer, DiLoCoCallback]:
    callback = DiLoCoCallback(
        role=role,
        node_id=name,
        hub_dir=str(tmp_path / "hub"),
        inner_steps=INNER,
        poll_interval=0.001,
        retry_initial=0.01,
        retry_max=0.1,
        keep_global_versions=1000,  # every evaluated global stays on the hub to check against
    )
    trainer = trainer_for([callback, JsonlCallback()], tmp_path / name, shard, evaluate=True)
    return trainer, callback


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def hub_global_loss(tmp_path: Path, outer_step: int) -> float:
    """The held-out loss of the hub's global model of ``outer_step``, evaluated afresh."""
    model = tiny_model()
    layout = build_layout(model.state_dict())
    data = (tmp_path / "hub" / model_file_name(outer_step)).read_bytes()
    weights = decode_global(data, layout, secret=None, outer_step=outer_step)
    model.load_state_dict(expand_aliases(weights, layout), strict=True)
    outcome = evaluate_model(model, held_out(), device=torch.device("cpu"))
    return outcome.metrics["eval/loss"]


def test_master_evaluates_each_global_model_and_workers_their_local_one(tmp_path: Path) -> None:
    master, master_cb = node(tmp_path, "master", "master", 0)
    worker, _ = node(tmp_path, "worker", "worker", 1)
    for chunk in range(1, 6):  # alternate short fits: both nodes make progress in turn
        master.fit(chunk * INNER)
        worker.fit(chunk * INNER)

    master_records = records(tmp_path / "master" / "metrics.jsonl")
    worker_records = records(tmp_path / "worker" / "metrics.jsonl")
    evaluated = [r for r in master_records if GLOBAL_EVAL_LOSS in r]
    assert master_cb.node is not None
    installs = master_cb.node.stats.installs
    assert installs >= 3  # the start-up global and at least two outer rounds
    # Every global the master installed was evaluated, each in the record of its install
    # step (metrics every step), labelled with its outer step.
    assert len(evaluated) == installs
    outer_steps = [r[GLOBAL_EVAL_OUTER_STEP] for r in evaluated]
    assert outer_steps == sorted(set(outer_steps))
    for record in evaluated:
        loss, ppl, outer = record[GLOBAL_EVAL_LOSS], record[GLOBAL_EVAL_PPL], outer_steps.pop(0)
        assert isinstance(loss, float) and isinstance(ppl, float) and isinstance(outer, int)
        assert math.isfinite(loss) and ppl == pytest.approx(math.exp(loss))
        assert outer == record["diloco/outer_step"]  # the global installed at this step
        # The number is the held-out loss of exactly that global model.
        assert loss == pytest.approx(hub_global_loss(tmp_path, outer), rel=1e-6)
    assert {GLOBAL_EVAL_PPL, GLOBAL_EVAL_OUTER_STEP}.isdisjoint(
        key for r in master_records if GLOBAL_EVAL_LOSS not in r for key in r
    )

    # Local evaluations: eval/loss on every evaluation step, on master and worker alike;
    # only the master evaluates global models.
    for node_records in (master_records, worker_records):
        local = [r for r in node_records if "eval/loss" in r]
        assert [r["step"] for r in local] == list(range(INNER, 5 * INNER + 1, INNER))
        for r in local:
            assert isinstance(r["eval/loss"], float) and math.isfinite(r["eval/loss"])
    assert not any(GLOBAL_EVAL_LOSS in r for r in worker_records)


def test_a_pending_global_evaluation_survives_the_checkpoint(tmp_path: Path) -> None:
    """An evaluation not yet in a record (installed between logging steps) is part of the
    callback's state, so a resumed run still logs it; bad state is a clear error."""
    callback = DiLoCoCallback(role="master", node_id="m", hub_dir=str(tmp_path / "hub"))
    assert "eval_global" not in callback.state_dict()  # nothing pending
    callback.global_eval = {
        GLOBAL_EVAL_LOSS: 1.5,
        GLOBAL_EVAL_PPL: math.exp(1.5),
        GLOBAL_EVAL_OUTER_STEP: 3,
    }
    buffer = io.BytesIO()
    torch.save(callback.state_dict(), buffer)  # the state loads without pickle
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    restored = DiLoCoCallback(
        role="master", node_id="m", hub_dir=str(tmp_path / "hub"), inner_steps=INNER
    )
    broken = {**state, "eval_global": {GLOBAL_EVAL_LOSS: "low"}}
    with pytest.raises(ValueError, match="eval_global"):
        restored.load_state_dict(broken)
    restored.load_state_dict(state)
    assert restored.state_dict()["eval_global"] == state["eval_global"]
    trainer = trainer_for([restored], tmp_path / "m", evaluate=False)
    first = trainer.fit(1).metrics[0]  # the resumed run logs it in its first record
    assert (first[GLOBAL_EVAL_LOSS], first[GLOBAL_EVAL_OUTER_STEP]) == (1.5, 3)
    assert restored.global_eval is None and "eval_global" not in restored.state_dict()


def test_no_global_evaluation_without_held_out_data(tmp_path: Path) -> None:
    callback = DiLoCoCallback(
        role="master",
        node_id="m",
        hub_dir=str(tmp_path / "hub"),
        inner_steps=INNER,
        poll_interval=0.001,
    )
    trainer = trainer_for([callback], tmp_path / "m", evaluate=False)
    # The first fit's end waits for the master's start-up (a background lane), so the
    # second installs the bootstrap global at its first step whatever the machine's load
    # (a single short fit could end before the start-up did: 2 failures in 6 under load).
    metrics = [*trainer.fit(1).metrics, *trainer.fit(3 * INNER).metrics]
    assert callback.node is not None and callback.node.stats.installs >= 1
    assert not any(key.startswith("diloco/eval_global/") for r in metrics for key in r)
    assert not any("eval/loss" in r for r in metrics)


def test_collective_mode_labels_evaluations_right_after_an_outer_round(tmp_path: Path) -> None:
    # One process: one replica, so the outer round with lr 0.7 still moves the weights.
    callback = CollectiveDiLoCo(inner_steps=2)
    model = tiny_model()
    trainer = Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        train_loader(0),
        callbacks=[callback],
        output_dir=tmp_path / "c",
        metrics_every=1,
        eval_data=held_out(),
        eval_every=3,
    )
    result = trainer.fit(6)
    evaluated = {int(r["step"]): r for r in result.metrics if "eval/loss" in r}
    assert sorted(evaluated) == [3, 6]
    assert GLOBAL_EVAL_LOSS not in evaluated[3]  # mid-round: the local replica only
    after_round = evaluated[6]  # outer round 3 ran at this step's coordinate, before eval
    assert after_round[GLOBAL_EVAL_LOSS] == after_round["eval/loss"]
    assert after_round[GLOBAL_EVAL_PPL] == pytest.approx(math.exp(float(after_round["eval/loss"])))
    assert after_round[GLOBAL_EVAL_OUTER_STEP] == 3
    assert sum(GLOBAL_EVAL_LOSS in r for r in result.metrics) == 1
