"""The original (2.0) DiLoCo API and configs, issue 15 items 3, 4 and 6: the names of 2.0's
``speedtronic.distributed``, ``HubClient``'s 2.0 signature, the ``distributed:`` keys (used or
refused at validation, never ignored), and a master continuing a hub written by 2.0."""

from __future__ import annotations

import re
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


# -- item 3: the original DiLoCo Python API ---------------------------------------------------

ORIGINAL_NAMES = (
    "DeltaUploadJob DumbDiLoCo DumbDiLoCoCoordinator GlobalMetadata HubClient HubError "
    "HubTransport HubUnavailable MasterOuterLoop NesterovOuterOptimizer SyncResult "
    "average_deltas compute_pseudo_gradient load_delta load_safetensors save_safetensors"
).split()
"""What 2.0's ``speedtronic.distributed`` exported (seed-distributed-v2.md, section 1.18)."""


def test_the_2_0_distributed_names_import_from_speedtronic_distributed() -> None:
    import speedtronic
    import speedtronic.distributed as distributed
    from speedtronic_callbacks.diloco import original_api

    assert sorted(original_api.__all__) == sorted(ORIGINAL_NAMES)
    for name in ORIGINAL_NAMES:
        assert getattr(distributed, name) is getattr(original_api, name), name
    assert distributed.HubTransport is distributed.HubClient
    assert distributed.DumbDiLoCo is distributed.DumbDiLoCoCoordinator
    assert speedtronic.HubClient is distributed.HubClient
    assert speedtronic.DumbDiLoCoCoordinator is distributed.DumbDiLoCoCoordinator
    assert issubclass(distributed.HubUnavailable, distributed.HubError)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        distributed.Nope  # noqa: B018


def test_hub_client_keeps_the_2_0_signature_methods_and_layout(tmp_path: Path) -> None:
    from speedtronic.distributed import GlobalMetadata, HubClient, HubError, load_delta
    from speedtronic_callbacks.diloco.directory_transport import DirectoryTransport

    with pytest.raises(ValueError, match="repo_id"):
        HubClient("")
    with_token = HubClient("team/run", token="hf_tok", cache_dir=tmp_path / "cache")
    assert with_token.transport.inner._token() == "hf_tok"  # type: ignore[attr-defined]  # the Hub store

    hub = HubClient("team/run", transport=DirectoryTransport(tmp_path / "hub"), cache_dir=tmp_path)
    hub.create_repo(private=True)
    assert hub.global_metadata() is None and hub.read_json("global/x.json", {"a": 1}) == {"a": 1}
    state = {"w": torch.arange(6.0).reshape(2, 3), "n": torch.tensor(4)}
    extra = {"algorithm": "dumb_diloco", "optimizer": "nesterov_sgd"}
    meta = hub.publish_global(state, outer_step=3, metadata_extra=extra)
    assert meta.outer_step == 3 and hub.global_metadata() == meta
    written = hub.read_json("global/step_count.json")
    assert written == {**meta.to_dict(), **extra}
    local = hub.download_global(tmp_path / "g.safetensors", meta)
    from speedtronic.distributed import load_safetensors

    loaded = load_safetensors(local)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["n"], state["n"])

    remote = hub.upload_delta(
        {"w": torch.ones(2, 3)}, node_id="n1", local_step=500, base_outer_step=3
    )
    assert remote == "nodes/n1/delta_500.safetensors"
    assert hub.delta_paths() == [remote] and hub.file_exists(remote)
    tensors, header = load_delta(hub.download(remote))
    assert torch.equal(tensors["w"], torch.ones(2, 3))
    assert header == {
        "node_id": "n1",
        "local_step": "500",
        "base_outer_step": "3",
        "algorithm": "dumb_diloco",
    }
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="unreadable delta"):
        load_delta(tmp_path / "bad.safetensors")
    with pytest.raises(FileNotFoundError):
        hub.upload(tmp_path / "missing.bin", "global/missing.bin")
    with pytest.raises(HubError, match="does not exist"):
        hub.download("global/none.json")
    with pytest.raises(HubError, match="organization"):
        hub.add_collaborator("alice")
    assert GlobalMetadata.from_dict({"step": "5"}) == GlobalMetadata(5, "")


@pytest.mark.parametrize("remote", ["../../escaped.bin", "nodes/../../../escaped.bin", "/abs.bin"])
def test_hub_client_download_refuses_a_name_that_leads_out_of_the_cache(
    tmp_path: Path, remote: str
) -> None:
    # <cache_dir>/downloads/<remote> was built from any name: with a transport that serves
    # it (one of the user's own, which checks nothing), "../.." wrote outside the cache.
    from speedtronic.distributed import HubClient, HubError
    from speedtronic_callbacks.diloco.directory_transport import DirectoryTransport

    class Lenient(DirectoryTransport):
        def get(self, path: str) -> bytes | None:
            return b"whatever the hub serves"

    cache = tmp_path / "a" / "b" / "cache"
    hub = HubClient("team/run", transport=Lenient(tmp_path / "hub"), cache_dir=cache)
    with pytest.raises(HubError, match=f"cannot download {re.escape(repr(remote))}: invalid"):
        hub.download(remote)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == []
    assert hub.download("nodes/n1/delta_5.safetensors").is_relative_to(cache / "downloads")


@pytest.mark.parametrize(
    "pointer", [b"junk", b'{"outer_step": "' + b"9" * 5000 + b'"}', b'{"step": "five"}']
)
def test_an_unusable_2_0_pointer_is_a_hub_error(tmp_path: Path, pointer: bytes) -> None:
    # A raw ValueError (json's, or int()'s digit limit) came out of global_metadata().
    from speedtronic.distributed import HubClient, HubError
    from speedtronic_callbacks.diloco.directory_transport import DirectoryTransport

    hub = HubClient("team/run", transport=DirectoryTransport(tmp_path / "hub"), cache_dir=tmp_path)
    hub.create_repo()
    (tmp_path / "hub" / "global").mkdir()
    (tmp_path / "hub" / "global" / "step_count.json").write_bytes(pointer)
    with pytest.raises(HubError, match="global/step_count.json in .* is unusable"):
        hub.global_metadata()


def test_nesterov_outer_optimizer_keeps_the_2_0_constructor() -> None:
    from speedtronic.distributed import NesterovOuterOptimizer

    state = {"theta": torch.tensor([1.0, 1.0]), "count": torch.tensor(2)}
    optimizer = NesterovOuterOptimizer(state, lr=0.1, momentum=0.9)
    assert set(optimizer.buffers) == {"theta"}
    optimizer.step(state, {"theta": torch.tensor([1.0, 2.0])})
    assert torch.allclose(state["theta"], torch.tensor([0.81, 0.62]))


def test_dumb_diloco_coordinator_runs_a_master_and_reports_2_0_events(tmp_path: Path) -> None:
    from speedtronic.compat.metric_logger import MetricLogger
    from speedtronic.distributed import DumbDiLoCoCoordinator, HubClient
    from speedtronic_callbacks.diloco.directory_transport import DirectoryTransport

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    seen: list[tuple[str, dict[str, object]]] = []
    logger = MetricLogger(echo=False, hooks=[lambda event, payload: seen.append((event, payload))])
    hub = HubClient("local/run", transport=DirectoryTransport(tmp_path / "hub"))
    section = {
        "enabled": True,
        "role": "master",
        "node_id": "master-1",
        "inner_steps": 1,
        "poll_interval": 0.001,
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
    }
    coordinator = DumbDiLoCoCoordinator(
        section, model, hub=hub, state_dir=tmp_path / "state", logger=logger
    )
    with pytest.raises(ValueError, match="another model"):
        coordinator.after_optimizer_step(torch.nn.Linear(3, 2), 1)
    coordinator.start()
    try:
        assert coordinator.node.wait_idle(10)  # the master published outer step 0
        for step in range(1, 30):
            with torch.no_grad():
                model.weight.add_(0.01)
            coordinator.after_optimizer_step(model, step)
            assert coordinator.node.wait_idle(10)
            if any(e == "outer_step" and p["deltas_included"] for e, p in seen):
                break
    finally:
        coordinator.stop()
    names = {event for event, _ in seen}
    assert {"delta_upload_queued", "delta_uploaded", "outer_step"} <= names
    assert coordinator.outer_step >= 1 and coordinator.last_global_step >= 0
    state = coordinator.state_dict()
    assert state["local_step"] == coordinator.local_step == step
    assert (tmp_path / "state" / "rounds-master-1.jsonl").is_file()  # state_dir is used


def test_a_2_0_coordinator_master_installs_the_2_0_global_and_continues(tmp_path: Path) -> None:
    """Item 6 through the public 2.0 API: ``DumbDiLoCoCoordinator`` as master on a 2.0 hub
    trains on from the 2.0 global model and outer step."""
    from speedtronic.distributed import DumbDiLoCoCoordinator

    hub = tmp_path / "hub"
    v2_state = write_v2_hub(hub, TiedModel(seed=0), outer_step=7)
    model = TiedModel(seed=1)
    section = {"enabled": True, "role": "master", "node_id": "m", "hub_dir": str(hub)}
    coordinator = DumbDiLoCoCoordinator(
        {**section, "inner_steps": 2, "poll_interval": 0.001}, model
    )
    coordinator.start()
    try:
        assert coordinator.node.wait_idle(10)
        assert coordinator.after_optimizer_step(model, 1) is True  # the 2.0 global installed
        assert torch.equal(model.emb.weight, v2_state["emb.weight"])
        assert coordinator.last_global_step == coordinator.outer_step == 7
        with torch.no_grad():
            model.norm.bias.add_(0.5)
        coordinator.after_optimizer_step(model, 2)  # a boundary: the master's own delta
        for step in range(3, 40):
            assert coordinator.node.wait_idle(10)
            if coordinator.outer_step > 7:
                break
            coordinator.after_optimizer_step(model, step)
    finally:
        coordinator.stop()
    assert coordinator.outer_step == 8
