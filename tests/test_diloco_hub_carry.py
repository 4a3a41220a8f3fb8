"""Hub mode's delta-carry rule: a node that installs a newer global model keeps the progress
it has not sent yet in its weights (``weights <- global + (weights now - weights at the last
upload)``) and sends it, based on that global, at its next boundary.

Before the rule a node installed the bare global and only queued its unsent progress: its
own work left its weights and came back a round later, scaled by ``outer_lr`` x the
staleness weight. At the test budget of tests/test_diloco_nodes.py that cost the nodes
12-25% of held-out loss against one node (docs/scale-out.md)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from speedtronic_callbacks.diloco.directory_transport import DirectoryTransport
from speedtronic_callbacks.diloco.master import MasterLoop, MasterSettings
from speedtronic_callbacks.diloco.model_layout import build_layout
from speedtronic_callbacks.diloco.node import DiLoCoNode, NodeSettings
from speedtronic_callbacks.diloco.transport_base import RetryingTransport, RetryPolicy


@pytest.fixture(autouse=True)
def _release_masters() -> Iterator[None]:
    yield
    MasterLoop._active.clear()


def make_model() -> nn.Linear:
    torch.manual_seed(0)  # every node starts from the same weights, as with a shared seed
    return nn.Linear(2, 1)


def retrying(hub: DirectoryTransport) -> RetryingTransport:
    return RetryingTransport(hub, RetryPolicy(attempts=2, initial=0.001, maximum=0.001))


def worker(hub: DirectoryTransport, node_id: str, inner_steps: int) -> DiLoCoNode:
    model = make_model()
    settings = NodeSettings(
        node_id=node_id, role="worker", inner_steps=inner_steps, poll_interval=0
    )
    node = DiLoCoNode(model, retrying(hub), build_layout(model.state_dict()), settings)
    node.start(0)
    assert node.wait_idle(10)  # its first poll has fetched outer step 0
    return node


def step(node: DiLoCoNode, number: int, move: float = 0.0) -> int | None:
    """Train (move every weight by ``move``), then the node's per-step work, settled."""
    with torch.no_grad():
        for parameter in node.model.parameters():
            parameter.add_(move)
    installed = node.on_step(number).installed
    assert node.wait_idle(10)
    return installed


def weights(node: DiLoCoNode) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in node.model.state_dict().items()}


def test_an_install_keeps_the_unsent_progress_and_rebases_it_on_the_new_global(
    tmp_path: Path,
) -> None:
    hub = DirectoryTransport(tmp_path / "hub")
    model = make_model()
    layout = build_layout(model.state_dict())
    settings = MasterSettings(
        node_id="m", outer_lr=1.0, outer_momentum=0.0, staleness_power=0.0, weight_by_work=False
    )
    master = MasterLoop(retrying(hub), layout, settings)
    master.reconcile(model.state_dict())  # publishes outer step 0: the shared start
    start = {key: value.clone() for key, value in model.state_dict().items()}
    carrier = worker(hub, "carrier", inner_steps=5)  # a boundary at step 5 only
    other = worker(hub, "other", inner_steps=1)  # uploads at every step
    assert step(carrier, 1) == 0 and step(other, 1) == 0  # both hold outer step 0

    step(carrier, 2, move=0.25)  # progress not sent yet (no boundary)
    step(other, 2, move=-0.5)  # a boundary: uploaded
    report = master.sync_once()
    assert report.published and report.outer_step == 1
    snapshot = master.snapshot()
    assert snapshot is not None
    global_1 = snapshot.global_state
    for key, value in start.items():  # lr 1, one fresh delta: the other node's weights
        torch.testing.assert_close(global_1[key], value - 0.5)

    step(carrier, 3)  # polls: the new global arrives
    assert step(carrier, 4) == 1  # and is installed
    after = weights(carrier)
    for key, value in global_1.items():
        torch.testing.assert_close(after[key], value + 0.25)  # the global plus its own work
    assert carrier.pending_base == 1  # that work now stands on the installed global
    with carrier.holding_global():  # what the master's eval_global evaluates
        for key, value in carrier.model.state_dict().items():
            torch.testing.assert_close(value, global_1[key])
    for key, value in carrier.model.state_dict().items():
        torch.testing.assert_close(value, after[key])

    step(carrier, 5)  # the boundary: it sends the carried work, based on outer step 1
    report = master.sync_once()
    assert [(item.node_id, item.base_outer_step, item.staleness) for item in report.applied] == [
        ("carrier", 1, 0)
    ]
    snapshot = master.snapshot()
    assert snapshot is not None
    for key, value in after.items():  # applied exactly once: the global is the carrier's
        torch.testing.assert_close(snapshot.global_state[key], value)
    carrier.stop()
    other.stop()


def test_a_node_without_unsent_progress_installs_the_bare_global(tmp_path: Path) -> None:
    hub = DirectoryTransport(tmp_path / "hub")
    model = make_model()
    layout = build_layout(model.state_dict())
    master = MasterLoop(retrying(hub), layout, MasterSettings(node_id="m", outer_momentum=0.0))
    master.reconcile(model.state_dict())
    idle = worker(hub, "idle", inner_steps=100)
    other = worker(hub, "other", inner_steps=1)
    assert step(idle, 1) == 0 and step(other, 1) == 0
    step(other, 2, move=-0.5)
    assert master.sync_once().published
    step(idle, 2)
    assert step(idle, 3) == 1
    snapshot = master.snapshot()
    assert snapshot is not None
    for key, value in idle.model.state_dict().items():
        assert torch.equal(value, snapshot.global_state[key])
    idle.stop()
    other.stop()
