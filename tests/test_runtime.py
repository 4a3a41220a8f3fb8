"""build_runtime / train_from_config: the composition root."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speedtronic import Callback, build_runtime, train_from_config
from speedtronic.engine.stage_streams import StageStreamCallback
from speedtronic.runtime import callback_specs, data_shard
from speedtronic.state.checkpoint import CheckpointManager
from speedtronic.systems.distributed import DistributedContext


def tiny(tmp_path: Path, **extra: object) -> dict[str, object]:
    config: dict[str, object] = {
        "run": {"device": "cpu", "max_steps": 2, "output_dir": str(tmp_path / "run")},
        "model": {"vocab_size": 32, "max_seq_len": 8, "n_layer": 1, "n_head": 4, "d_model": 32},
        "data": {"num_tokens": 32, "micro_batch_size": 2},
        "logging": {"console": False},
    }
    config.update(extra)
    return config


def test_runtime_builds_reference_model_and_manager(tmp_path: Path) -> None:
    trainer, manager = build_runtime(tiny(tmp_path))
    assert isinstance(trainer.model, torch.nn.Module)
    assert isinstance(manager, CheckpointManager)
    assert manager.directory == (tmp_path / "run" / "checkpoints").resolve()
    assert trainer.fit().steps == 2
    assert manager.latest_path() == manager.path_for(2)


def test_train_from_config_writes_config_and_metrics(tmp_path: Path) -> None:
    result = train_from_config(tiny(tmp_path))
    assert (result.steps, result.samples, result.tokens) == (2, 4, 32)
    assert (tmp_path / "run" / "config.yaml").is_file()
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def test_out_of_order_backprop_degrades_to_noop_on_cpu(tmp_path: Path) -> None:
    trainer, _ = build_runtime(tiny(tmp_path, ooo_backprop=True, ooo_streams=2))
    streams = [cb for cb in trainer.callbacks if isinstance(cb, StageStreamCallback)]
    assert len(streams) == 1
    assert streams[0].scheduler.enabled is False
    assert "cpu" in streams[0].scheduler.reason.lower()
    assert trainer.fit().steps == 2


def test_default_and_implied_callbacks_in_order(tmp_path: Path) -> None:
    from speedtronic.config import SpeedtronicConfig

    config = SpeedtronicConfig.from_dict(
        tiny(
            tmp_path,
            gradient_checkpointing=True,
            callbacks=[{"name": "csv"}],
            logging={"console": True, "json_file": "m.jsonl"},
        )
    )
    specs = callback_specs(config)
    assert [s.name for s in specs] == [
        "console",
        "jsonl",
        "csv",
        "gradient_checkpointing",
        "checkpoint",
    ]
    assert specs[1].options == {"path": "m.jsonl"}


def test_data_shard_prefers_a_callback_shard_without_torch_distributed() -> None:
    class Node(Callback):
        data_shard = (1, 3)

    assert data_shard([Callback(), Node()], None) == (1, 3)
    assert data_shard([Callback()], None) == (0, 1)


def test_data_shard_of_a_multi_rank_node_splits_the_node_shard_by_rank() -> None:
    class Node(Callback):
        data_shard = (1, 3)

    rank = DistributedContext(1, 2, 1, "gloo", torch.device("cpu"), 30.0)
    assert data_shard([Callback(), Node()], rank) == (3, 6)  # node 1's second half
    assert data_shard([Callback()], rank) == (1, 2)


def test_resume_without_checkpoint_warns_once_and_starts_fresh(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="no checkpoint") as caught:
        trainer, _ = build_runtime(tiny(tmp_path), resume=True)
    assert len([w for w in caught if "no checkpoint" in str(w.message)]) == 1
    assert trainer.step == 0
