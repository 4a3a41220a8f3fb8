"""One ``diloco`` plugin, two modes: asynchronous hub (default) and synchronous collective."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speedtronic.config import ConfigError, SpeedtronicConfig
from speedtronic.plugins import PluginContext, build_callback
from speedtronic_callbacks.diloco import DiLoCoCallback
from speedtronic_callbacks.diloco.collective import CollectiveDiLoCo


def config_with(options: dict[str, object]) -> SpeedtronicConfig:
    return SpeedtronicConfig.from_dict({"callbacks": [{"name": "diloco", **options}]})


def test_collective_mode_builds_the_synchronous_callback(tmp_path: Path) -> None:
    config = config_with({"mode": "collective", "inner_steps": 4, "compression": "bf16"})
    spec = config.callbacks[0]
    context = PluginContext(config=config, output_dir=tmp_path, device=torch.device("cpu"))
    callback = build_callback(spec.name, spec.options, context)
    assert isinstance(callback, CollectiveDiLoCo)
    assert callback.state_key == "diloco"


def test_hub_mode_is_the_default(tmp_path: Path) -> None:
    config = config_with({"hub_dir": str(tmp_path / "hub"), "role": "master"})
    spec = config.callbacks[0]
    context = PluginContext(config=config, output_dir=tmp_path, device=torch.device("cpu"))
    assert isinstance(build_callback(spec.name, spec.options, context), DiLoCoCallback)


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"mode": "collective", "hub_dir": "x"}, "hub_dir"),
        ({"hub_dir": "x", "ranks_per_replica": 2}, "ranks_per_replica"),
        ({"mode": "gossip"}, "gossip"),
        ({"hub_dir": "x", "repo_id": "a/b"}, "callbacks[0]"),
    ],
)
def test_each_mode_accepts_only_its_own_keys(options: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config_with(options)
    assert fragment in str(caught.value)


def test_a_hub_master_refuses_to_run_as_several_torchrun_ranks(tmp_path: Path) -> None:
    from types import SimpleNamespace
    from typing import cast

    from speedtronic import Trainer
    from speedtronic.engine.contexts import FitContext

    config = config_with({"hub_dir": str(tmp_path / "hub"), "role": "master"})
    spec = config.callbacks[0]
    context = PluginContext(config=config, output_dir=tmp_path, device=torch.device("cpu"))
    callback = build_callback(spec.name, spec.options, context)
    two_ranks = cast(Trainer, SimpleNamespace(multi_rank=True))
    with pytest.raises(RuntimeError, match="role: master runs as one process"):
        callback.on_setup(two_ranks, FitContext(0, 10))


def test_a_hub_node_refuses_fsdp_inside_its_torchrun_job(tmp_path: Path) -> None:
    from types import SimpleNamespace
    from typing import cast

    from speedtronic import Trainer
    from speedtronic.engine.contexts import FitContext

    config = config_with({"hub_dir": str(tmp_path / "hub"), "role": "worker"})
    spec = config.callbacks[0]
    context = PluginContext(config=config, output_dir=tmp_path, device=torch.device("cpu"))
    callback = build_callback(spec.name, spec.options, context)
    sharded = cast(Trainer, SimpleNamespace(multi_rank=True, sharded_state=True))
    with pytest.raises(RuntimeError, match="parallel.strategy: fsdp is not supported"):
        callback.on_setup(sharded, FitContext(0, 10))
