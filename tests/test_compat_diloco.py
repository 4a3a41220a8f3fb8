"""The original (2.0) DiLoCo API and configs, issue 15 items 3, 4 and 6: the names of 2.0's
``speedtronic.distributed``, ``HubClient``'s 2.0 signature, the ``distributed:`` keys (used or
refused at validation, never ignored), and a master continuing a hub written by 2.0."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speedtronic.config import ConfigError, SpeedtronicConfig
from speedtronic.plugins import PluginContext
from speedtronic.runtime import build_callbacks
from speedtronic_callbacks.diloco import DiLoCoCallback, HubTransport


def _enabled(**keys: object) -> dict[str, object]:
    return {"distributed": {"enabled": True, "repo_id": "team/run", **keys}}


# -- item 4: distributed: keys ---------------------------------------------------------------


def test_distributed_token_is_used_for_the_hub_and_never_shown(tmp_path: Path) -> None:
    config = SpeedtronicConfig.from_dict(_enabled(token="hf_secret_token"))
    context = PluginContext(config=config, output_dir=tmp_path, device=torch.device("cpu"))
    (diloco,) = [cb for cb in build_callbacks(config, context) if isinstance(cb, DiLoCoCallback)]
    assert diloco.options.token == "hf_secret_token"
    transport = diloco._build_transport().inner
    assert isinstance(transport, HubTransport)
    assert transport._token() == "hf_secret_token"  # used instead of $HF_TOKEN
    assert "hf_secret_token" not in repr(diloco.options)
    assert "hf_secret_token" not in config.to_yaml(redact_secrets=True)
    assert "hf_secret_token" not in str(transport._fail("put x", ValueError("hf_secret_token")))


@pytest.mark.parametrize(
    ("key", "value", "instead"),
    [
        ("collaborators", ["alice"], "organization"),
        ("cache_dir", "/tmp/cache", "into memory"),
        ("state_dir", "state", "checkpoint.directory"),
        ("async_delta_upload", False, "mode: collective"),
        ("async_global_poll", False, "mode: collective"),
    ],
)
def test_2_0_keys_without_a_counterpart_are_refused_at_validate(
    key: str, value: object, instead: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        SpeedtronicConfig.from_dict(_enabled(**{key: value}))
    message = str(caught.value)
    assert f"distributed.{key}" in message and "not supported" in message
    assert instead in message
    # the values that mean what the plugin does anyway, and a disabled section, are fine
    SpeedtronicConfig.from_dict(_enabled(async_delta_upload=True, cache_dir=".speedtronic/hub"))
    SpeedtronicConfig.from_dict({"distributed": {"enabled": False, key: value}})


# -- item 6: a 2.0 hub can be continued ------------------------------------------------------


class TiedModel(torch.nn.Module):
    """Tied embedding/head (2.0 saved both keys, cloned) and an integer buffer."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(8, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight
        self.norm = torch.nn.LayerNorm(4)
        self.register_buffer("count", torch.tensor(3))


def write_v2_hub(root: Path, model: torch.nn.Module, outer_step: int) -> dict[str, torch.Tensor]:
    """A hub exactly as speedtronic 2.0 left it (seed-distributed-v2.md, section 2)."""
    import json

    from safetensors.torch import save_file

    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    (root / "global").mkdir(parents=True)
    save_file(state, str(root / "global" / "latest.safetensors"))
    metadata = {
        "outer_step": outer_step,
        "updated_at": "2026-09-25T12:00:00+00:00",
        "model_file": "global/latest.safetensors",
        "algorithm": "dumb_diloco",
        "optimizer": "nesterov_sgd",
    }
    text = json.dumps(metadata, indent=2, sort_keys=True) + "\n"
    (root / "global" / "step_count.json").write_text(text)
    delta = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in state.items() if k != "count"}
    (root / "nodes" / "old-worker").mkdir(parents=True)
    header = {"node_id": "old-worker", "local_step": "500", "base_outer_step": "6"}
    save_file(delta, str(root / "nodes" / "old-worker" / "delta_500.safetensors"), header)
    return state


def test_a_master_continues_a_2_0_hub_from_its_global_model_and_outer_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from speedtronic_callbacks.diloco.directory_transport import DirectoryTransport
    from speedtronic_callbacks.diloco.master import MasterLoop, MasterSettings, delta_path
    from speedtronic_callbacks.diloco.math import pseudo_gradient
    from speedtronic_callbacks.diloco.model_layout import build_layout
    from speedtronic_callbacks.diloco.pointer import POINTER_PATH, decode_pointer
    from speedtronic_callbacks.diloco.transport_base import RetryingTransport
    from speedtronic_callbacks.diloco.wire import (
        DeltaInfo,
        encode_wire,
        global_tensors,
        parse_header,
        to_wire,
    )

    hub = tmp_path / "hub"
    v2_state = write_v2_hub(hub, TiedModel(seed=0), outer_step=7)
    fresh = TiedModel(seed=1)  # the new master's own (different) initial weights
    layout = build_layout(fresh.state_dict())
    transport = RetryingTransport(DirectoryTransport(hub))
    settings = MasterSettings(node_id="master-3", outer_lr=1.0, outer_momentum=0.0)
    loop = MasterLoop(transport, layout, settings)

    state = loop.reconcile(global_tensors(fresh.state_dict(), layout))

    assert state.outer_step == 7
    assert set(state.global_state) == {"emb.weight", "norm.weight", "norm.bias", "count"}
    for key, tensor in state.global_state.items():
        assert torch.equal(tensor, v2_state[key]), key
    assert "continued a speedtronic 2.0 hub" in caplog.text and "1 2.0 delta" in caplog.text
    pointer = decode_pointer(
        (hub / POINTER_PATH).read_bytes(), fingerprint=layout.fingerprint, secret=None
    )
    assert (pointer.outer_step, pointer.master) == (7, "master-3")

    # ... and continues: a worker's delta from outer step 7 becomes outer step 8
    current = {k: v - 0.25 if v.is_floating_point() else v for k, v in state.global_state.items()}
    delta = pseudo_gradient(state.global_state, current, layout.sync_keys)
    info = DeltaInfo(node_id="worker-1", local_step=10, base_outer_step=7, incarnation="i1")
    data = encode_wire(to_wire(delta, layout), info, layout)
    transport.put(delta_path("worker-1", 10, parse_header(data).metadata["sha256"]), data)
    report = loop.sync_once()
    assert (report.outer_step, report.included) == (8, 1)
    snapshot = loop.snapshot()
    assert snapshot is not None
    assert torch.allclose(snapshot.global_state["emb.weight"], v2_state["emb.weight"] - 0.25)
    # the 2.0 delta was never applied, and is still there for the operator
    assert (hub / "nodes" / "old-worker" / "delta_500.safetensors").is_file()


def test_a_2_0_hub_of_another_model_is_refused(tmp_path: Path) -> None:
    from speedtronic_callbacks.diloco.directory_transport import DirectoryTransport
    from speedtronic_callbacks.diloco.master import MasterLoop, MasterSettings
    from speedtronic_callbacks.diloco.model_layout import build_layout
    from speedtronic_callbacks.diloco.transport_base import RetryingTransport
    from speedtronic_callbacks.diloco.wire import Rejected, global_tensors

    hub = tmp_path / "hub"
    write_v2_hub(hub, torch.nn.Linear(3, 3), outer_step=2)
    fresh = TiedModel(seed=1)
    layout = build_layout(fresh.state_dict())
    loop = MasterLoop(RetryingTransport(DirectoryTransport(hub)), layout, MasterSettings("m"))
    with pytest.raises(Rejected, match="another model"):
        loop.reconcile(global_tensors(fresh.state_dict(), layout))
