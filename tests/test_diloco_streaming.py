"""Streaming DiLoCo: fragments, overlapped exchanges, exact resume; with int8/fp4 too.

In-process tests use one replica (the mean pseudo-gradient is the replica's own), which
makes every outer step computable by hand. The resume test runs two real gloo ranks, forked
from a ``forkserver`` that has already imported torch and speedtronic.
"""

from __future__ import annotations

import multiprocessing
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from cli_runner import run_cli
from distributed_worker import base_config
from test_distributed import free_port, rank_env
from torch import nn

from speedtronic.config import ConfigError, SpeedtronicConfig
from speedtronic.engine.callback import Callback
from speedtronic.engine.contexts import CoordinateContext, FitContext
from speedtronic.engine.trainer import Trainer
from speedtronic.runtime import build_runtime
from speedtronic_callbacks.diloco.collective import CollectiveDiLoCo
from speedtronic_callbacks.diloco.directory_transport import DirectoryTransport
from speedtronic_callbacks.diloco.encoding import Encoding
from speedtronic_callbacks.diloco.fragments import aggregate_by_key, find_blocks, plan_fragments
from speedtronic_callbacks.diloco.master import MasterLoop, MasterSettings, delta_path
from speedtronic_callbacks.diloco.math import NesterovOuterOptimizer, aggregate_deltas
from speedtronic_callbacks.diloco.model_layout import build_layout
from speedtronic_callbacks.diloco.node import DiLoCoNode, NodeSettings
from speedtronic_callbacks.diloco.transport_base import (
    RetryingTransport,
    RetryPolicy,
    TransientTransportError,
)
from speedtronic_callbacks.diloco.wire import (
    DeltaInfo,
    Rejected,
    RejectionReason,
    decode_delta,
    encode_wire,
    fragment_layout,
    parse_header,
    to_wire,
)


def config(out: Path, **sections: Mapping[str, object]) -> dict[str, object]:
    """``distributed_worker``'s tiny run with 4 blocks, no checkpoints, no metric files."""
    changes: dict[str, Mapping[str, object]] = {
        "run": {"seed": 5, "max_steps": 12},
        "model": {"n_layer": 4, "d_model": 16, "d_ff": 32},
        "logging": {"jsonl": False},
        "checkpoint": {"enabled": False},
    }
    for name, values in sections.items():
        changes[name] = {**changes.get(name, {}), **values}
    return base_config(out, **changes)


def fit(out: Path, *callbacks: Callback, **sections: Mapping[str, object]) -> Trainer:
    return build(out, *callbacks, **sections).fit_and_keep()


def build(out: Path, *callbacks: Callback, **sections: Mapping[str, object]) -> _Run:
    trainer, _ = build_runtime(config(out, **sections), extra_callbacks=list(callbacks))
    return _Run(trainer)


class _Run:
    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.losses: list[float] = []

    def fit_and_keep(self) -> Trainer:
        result = self.trainer.fit()
        self.losses = [float(record["loss"]) for record in result.metrics]
        return self.trainer


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in trainer.model.state_dict().items()}


# -- fragments ------------------------------------------------------------------------------


def test_fragments_are_strided_over_the_blocks_with_staggered_offsets(tmp_path: Path) -> None:
    trainer, _ = build_runtime(config(tmp_path))
    state = trainer.model.state_dict()
    layout = build_layout(state)
    blocks = find_blocks(list(state))
    assert blocks is not None and (blocks.container, blocks.count) == ("transformer.h", 4)
    plan = plan_fragments(list(state), layout.sync_keys, layout.aliases, fragments=2, inner_steps=8)
    first, second = (set(keys) for keys in plan.fragments)
    assert first | second == set(layout.sync_keys) and not first & second
    for key in layout.sync_keys:
        if key.startswith("transformer.h."):
            block = int(key.split(".")[2])
            assert key in (first if block % 2 == 0 else second)
    # The tied embedding/head comes before every block: fragment 0; the final norm comes
    # after block 3: block 3's fragment.
    assert "lm_head.weight" in first and "transformer.ln_f.weight" in second
    assert plan.offsets == (0, 4)
    assert [step for step in range(1, 17) if plan.due(step)] == [4, 8, 12, 16]
    assert plan.due(4) == [1] and plan.due(8) == [0]
    four = plan_fragments(
        list(state), layout.sync_keys, layout.aliases, fragments=4, inner_steps=10
    )
    assert four.offsets == (0, 2, 5, 7)
    one = plan_fragments(list(state), layout.sync_keys, layout.aliases, fragments=1, inner_steps=3)
    assert one.fragments == (layout.sync_keys,)
    assert [step for step in range(1, 10) if one.due(step)] == [3, 6, 9]


def test_more_fragments_than_blocks_is_a_clear_error_at_setup(tmp_path: Path) -> None:
    callback = CollectiveDiLoCo(inner_steps=10, fragments=5)
    with pytest.raises(ValueError, match=r"diloco.fragments: 5 is more than the model's 4 blocks"):
        fit(tmp_path, callback)
    flat = {"weight": torch.zeros(2), "bias": torch.zeros(2)}
    with pytest.raises(ValueError, match="no numbered list of blocks"):
        plan_fragments(list(flat), ("bias", "weight"), {}, fragments=2, inner_steps=4)


def test_overlap_must_end_before_the_next_fragment_starts(tmp_path: Path) -> None:
    entry = {"name": "diloco", "mode": "collective", "inner_steps": 8, "fragments": 4}
    SpeedtronicConfig.from_dict({"callbacks": [{**entry, "overlap_steps": 1}]})
    with pytest.raises(ConfigError, match=r"callbacks\[0\]\.overlap_steps: 2 is not below"):
        SpeedtronicConfig.from_dict({"callbacks": [{**entry, "overlap_steps": 2}]})
    with pytest.raises(ValueError, match="overlap_steps: 8 is not below inner_steps"):
        CollectiveDiLoCo(inner_steps=8, overlap_steps=8)
    with pytest.raises(ConfigError, match="fragments"):
        SpeedtronicConfig.from_dict({"callbacks": [{**entry, "fragments": 0}]})
    hub = {"name": "diloco", "hub_dir": "h", "fragments": 2, "overlap_steps": 1}
    with pytest.raises(ConfigError, match="overlap_steps: is an option of mode: collective"):
        SpeedtronicConfig.from_dict({"callbacks": [hub]})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"callbacks": [{**entry, "overlap_steps": 3}]}))
    done = run_cli("validate", "--config", str(path), cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "callbacks[0].overlap_steps: 3 is not below inner_steps / fragments" in done.stderr


# -- P = 1, tau = 0 is today's DiLoCo -----------------------------------------------------


class PlainDiLoCo(Callback):
    """DiLoCo as it was before streaming, written out for one replica: every ``H`` steps
    the float32 pseudo-gradient goes through one Nesterov step and the result is loaded."""

    def __init__(self, inner_steps: int) -> None:
        self.inner_steps = inner_steps
        self.outer = NesterovOuterOptimizer(0.7, 0.9)
        self.baseline: dict[str, torch.Tensor] = {}

    def on_setup(self, trainer: Trainer, ctx: FitContext) -> None:
        state = trainer.model.state_dict()
        keys = build_layout(state).sync_keys
        self.baseline = {key: state[key].detach().float().clone() for key in keys}

    def on_coordinate(self, trainer: Trainer, ctx: CoordinateContext) -> None:
        if ctx.step % self.inner_steps:
            return
        state = trainer.model.state_dict()
        keys = build_layout(state).sync_keys
        delta = {key: self.baseline[key] - state[key].detach().float() for key in keys}
        self.outer.step(self.baseline, delta)
        with torch.no_grad():
            for key in keys:
                state[key].copy_(self.baseline[key])
        trainer.request_optimizer_reset("plain")


def test_one_fragment_without_overlap_is_bit_identical_to_plain_diloco(tmp_path: Path) -> None:
    def run(name: str, callback: Callback) -> tuple[dict[str, torch.Tensor], list[float]]:
        handle = build(tmp_path / name, callback)
        return weights(handle.fit_and_keep()), handle.losses

    expected = run("plain", PlainDiLoCo(inner_steps=4))
    assert len(expected[1]) == 12
    for name, callback in {
        "unset": CollectiveDiLoCo(inner_steps=4),
        "explicit": CollectiveDiLoCo(inner_steps=4, fragments=1, overlap_steps=0),
    }.items():
        actual = run(name, callback)
        assert actual[1] == expected[1], name
        for key, value in expected[0].items():
            assert torch.equal(actual[0][key], value), (name, key)
        assert callback.outer_steps == 3 and callback.peak_sync_bytes == 0  # one replica


# -- overlap: the delta-carry rule ------------------------------------------------------


class Snapshots(Callback):
    """The model's weights at every ``coordinate`` event (before or after DiLoCo acts,
    depending on where it sits in the callback list)."""

    def __init__(self) -> None:
        self.seen: dict[int, dict[str, torch.Tensor]] = {}

    def on_coordinate(self, trainer: Trainer, ctx: CoordinateContext) -> None:
        self.seen[ctx.step] = weights(trainer)


def test_overlapped_exchange_is_applied_tau_steps_later_keeping_local_progress(
    tmp_path: Path,
) -> None:
    before, after = Snapshots(), Snapshots()
    diloco = CollectiveDiLoCo(
        inner_steps=8, fragments=2, overlap_steps=2, outer_lr=0.7, outer_momentum=0.9
    )
    handle = build(tmp_path, before, diloco, after, run={"max_steps": 10})
    start = weights(handle.trainer)
    trainer = handle.fit_and_keep()
    assert diloco.plan is not None
    first, second = diloco.plan.fragments  # offsets 0 and 4: starts at 4 and 8
    # Applied at 6 (fragment 1, started at 4) and at 10 (fragment 0, started at 8).
    assert diloco.outer_steps == 2 and not diloco.in_flight
    for step in (1, 2, 3, 4, 5, 7, 8, 9):  # nothing is loaded on these steps
        for key, value in before.seen[step].items():
            assert torch.equal(after.seen[step][key], value), (step, key)

    def expected(key: str, started: int, applied: int) -> torch.Tensor:
        """global + (now - snapshot); the global is one Nesterov step (fresh momentum:
        ``(1 + mu) * g``) from the start weights with ``g = start - snapshot``."""
        snapshot = before.seen[started][key]
        new_global = start[key] - 0.7 * 1.9 * (start[key] - snapshot)
        return new_global + (before.seen[applied][key] - snapshot)

    for key in second:
        torch.testing.assert_close(after.seen[6][key], expected(key, 4, 6), rtol=0, atol=1e-6)
    for key in first:
        assert torch.equal(after.seen[6][key], before.seen[6][key])
        torch.testing.assert_close(after.seen[10][key], expected(key, 8, 10), rtol=0, atol=1e-6)
    assert trainer.step == 10


def test_without_overlap_each_fragment_is_replaced_by_its_global(tmp_path: Path) -> None:
    before, after = Snapshots(), Snapshots()
    diloco = CollectiveDiLoCo(inner_steps=4, fragments=4, outer_lr=1.0, outer_momentum=0.0)
    fit(tmp_path, before, diloco, after, run={"max_steps": 4})
    assert diloco.plan is not None and diloco.plan.offsets == (0, 1, 2, 3)
    # outer lr 1 without momentum: the new global is the replica's own weights.
    for step, fragment in ((1, 1), (2, 2), (3, 3), (4, 0)):
        synced = diloco.plan.fragments[fragment]
        assert diloco.layout is not None
        for key, value in before.seen[step].items():
            if diloco.layout.aliases.get(key, key) in synced:  # tied weights: both names
                torch.testing.assert_close(after.seen[step][key], value, rtol=0, atol=1e-7)
            else:
                assert torch.equal(after.seen[step][key], value), (step, key)
    assert diloco.outer_steps == 4


# -- exact resume with an exchange in flight: two gloo ranks -------------------------------


def _rank(rank: int, port: int, out: str, delta_dtype: str | None = None) -> None:
    """One rank: 10 steps straight, then 4 steps (checkpoint at 4 with fragment 1's exchange
    in flight until 6) and a resume to 10. Saves the final weights and losses, and what the
    straight run's callback holds (global model, residuals, norm histories, bytes)."""
    os.environ.update(rank_env(rank, 2, port))  # what torchrun sets
    torch.set_num_threads(1)
    root = Path(out)

    def run(
        name: str, steps: int, resume: bool = False
    ) -> tuple[Trainer, list[float], CollectiveDiLoCo]:
        sections = config(
            root / name,
            run={"max_steps": steps},
            checkpoint={"enabled": True, "every_steps": 4, "keep_last": None},
            distributed={"timeout_s": 30.0},
        )
        callback = CollectiveDiLoCo(
            inner_steps=8, fragments=2, overlap_steps=2, delta_dtype=delta_dtype
        )
        trainer, _ = build_runtime(sections, resume=resume, extra_callbacks=[callback])
        result = trainer.fit()
        return trainer, [float(r["loss"]) for r in result.metrics], callback

    full, full_losses, diloco = run("full", 10)
    run("part", 4)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="diloco")  # no "from rank 0" warning
        resumed, resumed_losses, _ = run("part", 10, resume=True)
    torch.save(
        {
            "full": weights(full),
            "resumed": weights(resumed),
            "full_losses": full_losses,
            "resumed_losses": resumed_losses,
            "baseline": dict(diloco.baseline),
            "residuals": list(diloco.residuals),
            "norms": [history.to_list() for history in diloco.norm_histories],
            "peak_sync_bytes": diloco.peak_sync_bytes,
        },
        root / f"rank{rank}.pt",
    )


def _two_ranks(out: Path, delta_dtype: str | None = None) -> list[dict[str, object]]:
    """``_rank`` on two gloo ranks; their saved results."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch._dynamo", "speedtronic.runtime"])
    port = free_port()
    ranks = [
        context.Process(target=_rank, args=(rank, port, str(out), delta_dtype), daemon=True)
        for rank in (0, 1)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
        assert process.exitcode == 0
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1)]


def test_checkpoint_with_an_exchange_in_flight_resumes_exactly_on_two_ranks(
    tmp_path: Path,
) -> None:
    results: list[dict[str, Any]] = _two_ranks(tmp_path)
    for result in results:
        assert result["resumed_losses"] == result["full_losses"][4:]
        for key, value in result["full"].items():
            assert torch.equal(result["resumed"][key], value), key
    # The replicas really differ (fragment 0 has not synchronised since step 8)...
    assert any(
        not torch.equal(results[0]["full"][key], value) for key, value in results[1]["full"].items()
    )


def test_fp4_fragments_overlap_and_resume_exactly_on_two_ranks(tmp_path: Path) -> None:
    """fp4 with fragments and overlap: the packed all-gathers run in the background, both
    ranks decode the same global, each fragment keeps its own residual and norm history,
    and the checkpoint (residuals included) resumes exactly with an exchange in flight."""
    results: list[dict[str, Any]] = _two_ranks(tmp_path, "fp4")
    for result in results:
        assert result["resumed_losses"] == result["full_losses"][4:]
        for key, value in result["full"].items():
            assert torch.equal(result["resumed"][key], value), key
        # fragment 1 exchanged at step 4, fragment 0 at step 8: two replicas' norms each
        assert [len(norms) for norms in result["norms"]] == [2, 2]
        assert all(residual.abs().max() > 0 for residual in result["residuals"])
    first, second = results
    for key, value in first["baseline"].items():
        assert torch.equal(second["baseline"][key], value), key  # the same global everywhere
    assert first["norms"] == second["norms"]  # every rank judged the same numbers
    assert not torch.equal(first["residuals"][0], second["residuals"][0])  # per replica
    fragment_values = max(residual.numel() for residual in first["residuals"])
    assert first["peak_sync_bytes"] < fragment_values  # under 1 byte a value: 1/4 of fp32


# -- hub mode: fragments travel as whole files ----------------------------------------------


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)  # every node starts from the same weights
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))  # blocks "0" and "2"


class _LoseFirstUpload(DirectoryTransport):
    """A hub whose first delta upload is lost on the way (nothing arrives)."""

    lost: list[str]

    def put(self, path: str, data: bytes) -> None:
        if path.startswith("nodes/") and not self.lost:
            self.lost.append(path)
            raise TransientTransportError("put", "connection reset")
        super().put(path, data)


class _HubNode:
    def __init__(
        self,
        hub: DirectoryTransport,
        node_id: str,
        role: str,
        seed: int,
        delta_dtype: Encoding | None = None,
    ) -> None:
        self.model = _mlp()
        layout = build_layout(self.model.state_dict())
        policy = RetryPolicy(attempts=1, initial=0.001, maximum=0.001, timeout=10)
        transport = RetryingTransport(hub, policy, sleep=lambda _: None)
        master = None
        if role == "master":
            settings = MasterSettings(node_id=node_id, delete_applied=False, outer_momentum=0.0)
            master = MasterLoop(transport, layout, settings)
        self.node = DiLoCoNode(
            self.model,
            transport,
            layout,
            NodeSettings(
                node_id=node_id,
                role="master" if role == "master" else "worker",
                inner_steps=4,
                poll_interval=0.0,
                fragments=2,
                delta_dtype=delta_dtype,
            ),
            master=master,
        )
        self.inputs = torch.randn(32, 4, generator=torch.Generator().manual_seed(seed))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.step = 0
        self.node.start(0)
        assert self.node.wait_idle(10)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.step += 1
            target = self.inputs.sum(dim=1, keepdim=True)
            loss = nn.functional.mse_loss(self.model(self.inputs), target)
            self.optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
            self.optimizer.step()
            self.node.on_step(self.step)
            assert self.node.wait_idle(10)


def test_hub_fragments_are_sent_whole_and_a_lost_one_is_resent_before_new_work(
    tmp_path: Path,
) -> None:
    MasterLoop._active.clear()
    hub = _LoseFirstUpload(tmp_path / "hub")
    hub.lost = []
    master = _HubNode(hub, "master", "master", seed=1)
    worker = _HubNode(hub, "worker", "worker", seed=2)
    layout = worker.node.layout
    first, second = worker.node.plan.fragments  # blocks "0" and "2"; offsets 0 and 2
    assert first == ("0.bias", "0.weight") and second == ("2.bias", "2.weight")
    worker.train(2)  # installs outer step 0; step 2: fragment 1's upload is lost
    assert len(hub.lost) == 1 and worker.node.unconfirmed is not None
    assert worker.node.unconfirmed.fragment == "1/2"
    worker.train(2)  # step 4 (fragment 0's turn): the lost upload goes first, unchanged
    files = {f.path for f in hub.list_files("nodes/worker")}
    assert files == set(hub.lost) and worker.node.unconfirmed is None
    pending = worker.node.pending
    assert pending is not None and all(bool(pending[key].any()) for key in first)
    assert master.node.master is not None
    before = master.node.master.snapshot()
    report = master.node.master.sync_once()  # applies fragment 1 only
    after = master.node.master.snapshot()
    assert before is not None and after is not None and report.published
    assert [item.local_step for item in report.applied] == [2]
    for key in first:
        assert torch.equal(after.global_state[key], before.global_state[key])
    for key in second:
        assert not torch.equal(after.global_state[key], before.global_state[key])
    worker.train(4)  # step 6: fragment 1 again; step 8: fragment 0 with all its progress
    sent = {}
    for item in hub.list_files("nodes/worker"):
        data = hub.get(item.path)
        assert data is not None
        decoded = decode_delta(data, layout, secret=None)
        sent[decoded.info.local_step] = (decoded.info.fragment, tuple(sorted(decoded.tensors)))
    assert sent == {2: ("1/2", second), 6: ("1/2", second), 8: ("0/2", first)}
    report = master.node.master.sync_once()
    assert sorted(item.local_step for item in report.applied) == [6, 8]
    # Half a fragment on the hub: a logged rejection, and the global does not move.
    half = {"0.weight": torch.ones(layout.wire_shapes["0.weight"])}
    info = DeltaInfo(node_id="evil", local_step=9, base_outer_step=2, fragment="0/2")
    data = encode_wire(half, info, layout)
    hub.put(delta_path("evil", 9, parse_header(data).metadata["sha256"]), data)
    before = master.node.master.snapshot()
    report = master.node.master.sync_once()
    assert not report.published and [r.reason for r in report.rejected] == [
        RejectionReason.WRONG_KEYS
    ]
    unchanged = master.node.master.snapshot()
    assert before is not None and unchanged is not None
    assert unchanged.outer_step == before.outer_step
    for key, value in before.global_state.items():
        assert torch.equal(unchanged.global_state[key], value)
    worker.node.stop()
    master.node.stop()


@pytest.mark.parametrize(
    ("fragment", "keys", "reason"),
    [
        ("0/2", ("0.weight",), RejectionReason.WRONG_KEYS),  # half a fragment
        ("0/2", ("2.bias", "2.weight"), RejectionReason.WRONG_KEYS),  # another fragment
        ("0/2", ("0.bias", "0.weight", "2.bias"), RejectionReason.WRONG_KEYS),
        ("", ("0.bias", "0.weight"), RejectionReason.WRONG_KEYS),  # a whole model, truncated
        ("2/2", ("0.bias", "0.weight"), RejectionReason.BAD_METADATA),
        ("0/3", ("0.bias", "0.weight"), RejectionReason.BAD_METADATA),  # 2 blocks only
        ("first", ("0.bias", "0.weight"), RejectionReason.BAD_METADATA),
    ],
)
def test_a_fragment_file_is_accepted_whole_or_rejected(
    fragment: str, keys: tuple[str, ...], reason: RejectionReason
) -> None:
    layout = build_layout(_mlp().state_dict())
    tensors = {key: torch.ones(layout.wire_shapes[key]) for key in keys}
    info = DeltaInfo(node_id="w", local_step=4, base_outer_step=0, fragment=fragment)
    data = encode_wire(tensors, info, layout)
    with pytest.raises(Rejected) as caught:
        decode_delta(data, layout, secret=None)
    assert caught.value.reason is reason
    whole = {key: torch.ones(layout.wire_shapes[key]) for key in ("0.bias", "0.weight")}
    good = DeltaInfo(node_id="w", local_step=4, base_outer_step=0, fragment="0/2")
    assert set(decode_delta(encode_wire(whole, good, layout), layout, secret=None).tensors) == {
        "0.bias",
        "0.weight",
    }


def test_int8_fragment_files_record_both_and_the_master_checks_both(tmp_path: Path) -> None:
    MasterLoop._active.clear()
    hub = DirectoryTransport(tmp_path / "hub")
    master = _HubNode(hub, "master", "master", seed=1, delta_dtype=Encoding.INT8)
    worker = _HubNode(hub, "worker", "worker", seed=2, delta_dtype=Encoding.INT8)
    layout = worker.node.layout
    first, second = worker.node.plan.fragments
    worker.train(4)  # step 2: fragment 1; step 4: fragment 0
    sizes = {"0/2": 4 * 4 + 4, "1/2": 4 + 1}
    for item in hub.list_files("nodes/worker"):
        data = hub.get(item.path)
        assert data is not None
        meta = parse_header(data).metadata
        assert meta["encoding"] == "int8" and int(meta["values"]) == sizes[meta["fragment"]]
        decoded = decode_delta(data, layout, secret=None)
        assert decoded.encoding is Encoding.INT8
        keys = first if decoded.info.fragment == "0/2" else second
        assert tuple(sorted(decoded.tensors)) == keys
    pending = worker.node.pending  # error feedback: what int8 dropped waits for the next send
    assert pending is not None and any(bool(pending[key].any()) for key in first + second)
    assert master.node.master is not None
    report = master.node.master.sync_once()
    assert report.published and sorted(item.local_step for item in report.applied) == [2, 4]
    history = master.node.master.state_dict()["fragment_norm_history"]
    assert isinstance(history, dict) and sorted(history) == ["0/2", "1/2"]  # one per fragment
    # An int8 file whose fragment field names another fragment than its codes hold.
    delta = {key: torch.full(layout.wire_shapes[key], 0.01) for key in first}
    wire = to_wire(delta, fragment_layout(layout, "0/2"), Encoding.INT8)
    for fragment, reason in (
        ("1/2", RejectionReason.BAD_PACKING),
        ("", RejectionReason.BAD_PACKING),
    ):
        info = DeltaInfo(node_id="evil", local_step=9, base_outer_step=1, fragment=fragment)
        data = encode_wire(wire, info, layout, encoding=Encoding.INT8)
        with pytest.raises(Rejected) as caught:
            decode_delta(data, layout, secret=None)
        assert caught.value.reason is reason, fragment
    info = DeltaInfo(node_id="good", local_step=9, base_outer_step=1, fragment="0/2")
    decoded = decode_delta(
        encode_wire(wire, info, layout, encoding=Encoding.INT8), layout, secret=None
    )
    for key in first:
        assert torch.allclose(decoded.tensors[key], delta[key], atol=1e-3)
    worker.node.stop()
    master.node.stop()


def test_hub_fragments_larger_than_the_block_count_fail_at_setup(tmp_path: Path) -> None:
    model = _mlp()
    hub = RetryingTransport(DirectoryTransport(tmp_path), RetryPolicy(attempts=1))
    settings = NodeSettings(node_id="w", role="worker", fragments=3)
    with pytest.raises(ValueError, match="diloco.fragments: 3 is more than the model's 2 blocks"):
        DiLoCoNode(model, hub, build_layout(model.state_dict()), settings)


def test_the_master_averages_each_key_over_the_deltas_that_hold_it() -> None:
    whole = {"a": torch.full((2,), 4.0), "b": torch.full((2,), 8.0)}
    fragment_a = {"a": torch.full((2,), 2.0)}
    fragment_b = {"b": torch.full((2,), 6.0)}
    mixed = aggregate_by_key([whole, fragment_a, fragment_b], [1.0, 0.5, 1.0])
    assert torch.equal(mixed["a"], torch.full((2,), (4.0 + 0.5 * 2.0) / 2))
    assert torch.equal(mixed["b"], torch.full((2,), (8.0 + 6.0) / 2))
    same = aggregate_by_key([fragment_a, {"a": torch.zeros(2)}], [1.0, 1.0])
    assert torch.equal(same["a"], aggregate_deltas([fragment_a, {"a": torch.zeros(2)}])["a"])
