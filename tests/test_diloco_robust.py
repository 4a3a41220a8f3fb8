"""Robust aggregation and work weighting (``diloco.aggregation``) in the hub master and in
collective mode, and the low-bit node path with error feedback -- all in one process."""

from __future__ import annotations

import io
import logging
import statistics
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from speedtronic import Trainer
from speedtronic.config import ConfigError, SpeedtronicConfig
from speedtronic.config.sections import OptimizerConfig
from speedtronic.runtime import optimizer_section
from speedtronic_callbacks.diloco import DiLoCoCallback
from speedtronic_callbacks.diloco.aggregation import (
    NormHistory,
    RobustSettings,
    Screens,
    screen,
    work_weights,
)
from speedtronic_callbacks.diloco.collective import CollectiveDiLoCo
from speedtronic_callbacks.diloco.directory_transport import DirectoryTransport
from speedtronic_callbacks.diloco.encoding import Encoding, round_trip
from speedtronic_callbacks.diloco.master import MasterLoop, MasterSettings, delta_path
from speedtronic_callbacks.diloco.model_layout import ModelLayout, build_layout
from speedtronic_callbacks.diloco.node import DiLoCoNode, NodeSettings
from speedtronic_callbacks.diloco.options import CollectiveDiLoCoOptions, DiLoCoOptions
from speedtronic_callbacks.diloco.outer_round import replica_coefficients
from speedtronic_callbacks.diloco.transport_base import RetryingTransport, RetryPolicy
from speedtronic_callbacks.diloco.wire import (
    DeltaInfo,
    RejectionReason,
    encode_delta,
    encode_file,
    flatten_delta,
    parse_header,
    to_wire,
)

torch.set_num_threads(1)


# -- the rules ----------------------------------------------------------------------------


def test_an_outlier_is_clipped_to_the_bound_or_rejected() -> None:
    history = NormHistory(4, [1.0, 2.0, 1.5])
    clip = screen([1.2, 1e6], history, RobustSettings("clip", factor=10.0))
    assert clip.bound == pytest.approx(15.0)  # 10 x median(1, 2, 1.5, 1.2, 1e6)
    assert clip.factors[0] == 1.0 and clip.factors[1] * 1e6 == pytest.approx(15.0)
    assert clip.applied_norms([1.2, 1e6]) == pytest.approx([1.2, 15.0])
    reject = screen([1.2, 1e6], history, RobustSettings("reject", factor=10.0))
    assert reject.factors == (1.0, 0.0) and reject.kept == 1 and reject.outliers == (1,)
    off = screen([1.2, 1e6], history, RobustSettings("off"))
    assert off.factors == (1.0, 1.0) and off.bound is None
    nan = screen([float("nan"), 1.0], history, RobustSettings("clip"))
    assert nan.factors == (0.0, 1.0)


def test_before_the_median_is_known_the_model_norm_bounds_a_delta() -> None:
    empty = NormHistory(8)
    assert screen([1e6], empty, RobustSettings(), model_norm=3.0).factors[0] == pytest.approx(
        30.0 / 1e6
    )
    assert screen([1e6], empty, RobustSettings(), model_norm=None).factors == (1.0,)
    assert screen([1e6], empty, RobustSettings(), model_norm=0.0).factors == (1.0,)


def test_screens_keep_a_history_per_group_and_measure_the_model_only_while_it_is_short() -> None:
    """The master and the collective exchange judge rounds through one ``Screens``: each
    group (a fragment, a work unit) is judged against its own history only, and the model
    norm -- a pass over the global's entries -- is computed only while that history is too
    short to trust its median."""
    screens = Screens(RobustSettings("clip", factor=10.0))
    measured: list[str] = []

    def model_norm(group: str) -> float:
        measured.append(group)
        return 3.0

    first = screens.judge("0/2", [1e6], lambda: model_norm("0/2"))
    assert first.bound == pytest.approx(30.0) and measured == ["0/2"]
    screens.record("0/2", first.applied_norms([1e6]))  # applied at the bound, 30
    screens.record("0/2", [20.0, 40.0])
    # Three norms known for 0/2: the median bounds it, the model is not measured again.
    second = screens.judge("0/2", [1e3], lambda: model_norm("0/2"))
    assert second.bound == pytest.approx(10.0 * statistics.median([30.0, 20.0, 40.0, 1e3]))
    assert measured == ["0/2"]
    # Fragment 1/2 is judged on its own: its history is empty, so the model sets its bound.
    other = screens.judge("1/2", [1e6], lambda: model_norm("1/2"))
    assert other.bound == pytest.approx(30.0) and measured == ["0/2", "1/2"]
    assert screens.history("1/2").to_list() == []  # judging does not record
    # A group judged without a reference (work claims) has no bound until three are known.
    assert screens.judge("tokens", [1e9]).bound is None


def test_the_history_keeps_the_last_window_of_finite_norms() -> None:
    history = NormHistory(3)
    history.record([1.0, 2.0, float("inf"), 3.0, 4.0])
    assert history.to_list() == [2.0, 3.0, 4.0]
    assert NormHistory.from_state(3, [1, 2.5]).to_list() == [1.0, 2.5]
    with pytest.raises(ValueError, match="norm_history"):
        NormHistory.from_state(3, "junk")
    with pytest.raises(ValueError, match="outlier_factor"):
        RobustSettings(factor=1.0)


def test_work_weights_are_relative_to_the_mean_and_exactly_one_when_equal() -> None:
    assert work_weights([100, 100, 100], [4, 4, 4]) == [1.0, 1.0, 1.0]
    assert work_weights([100, 300], [1, 1]) == [0.5, 1.5]
    assert work_weights([0, 300], [2, 6]) == [0.5, 1.5]  # tokens unknown: samples
    assert work_weights([0, 0], [0, 3]) == [1.0, 1.0]  # nothing known: equal


def test_collective_coefficients_average_the_kept_replicas() -> None:
    history = NormHistory(8, [1.0, 1.0, 1.0])
    reject = RobustSettings("reject")
    coefficients, screening = replica_coefficients(
        [1.0, 1e6, 1.0], [10, 10, 30], [1, 1, 1], history, reject, weight_by_work=True
    )
    # Replica 1 is left out; the others are weighted 0.5 / 1.5 and rescaled by 3 / 2.
    assert coefficients == pytest.approx([0.75, 0.0, 2.25])
    assert screening.kept == 2
    plain, _ = replica_coefficients(
        [1.0, 1.1], [10, 10], [1, 1], history, reject, weight_by_work=True
    )
    assert plain == [1.0, 1.0]
    none, _ = replica_coefficients(
        [1e6, 1e7], [1, 1], [1, 1], history, reject, weight_by_work=False
    )
    assert none == [0.0, 0.0]


def test_diloco_runs_leave_norms_and_biases_out_of_weight_decay_by_default() -> None:
    section = OptimizerConfig()
    for callback in (DiLoCoCallback(hub_dir="x"), CollectiveDiLoCo()):
        assert optimizer_section(section, [callback]).decay_norms_and_biases is False
    explicit = replace(section, decay_norms_and_biases=True)  # the documented switch
    assert optimizer_section(explicit, [CollectiveDiLoCo()]).decay_norms_and_biases is True


@pytest.mark.parametrize("mode", ["hub", "collective"])
def test_config_validation_names_bad_encoding_and_robustness_options(mode: str) -> None:
    base: dict[str, object] = {"name": "diloco", "mode": mode}
    if mode == "hub":
        base["hub_dir"] = "x"
    good = SpeedtronicConfig.from_dict({"callbacks": [{**base, "delta_dtype": "fp4"}]})
    assert good.callbacks[0].options["delta_dtype"] == "fp4"
    for bad, fragment in (
        ({"delta_dtype": "fp3"}, "callbacks[0].delta_dtype"),
        ({"delta_dtype": "int8", "compression": "bf16"}, "set delta_dtype or compression"),
        ({"outlier_policy": "ignore"}, "callbacks[0].outlier_policy"),
        ({"outlier_factor": 1}, "callbacks[0].outlier_factor"),
    ):
        with pytest.raises(ConfigError) as caught:
            SpeedtronicConfig.from_dict({"callbacks": [{**base, **bad}]})
        assert fragment in str(caught.value)


def test_options_take_delta_dtype_or_compression_but_not_both() -> None:
    assert DiLoCoOptions(hub_dir="x", delta_dtype="fp4").delta_dtype == "fp4"
    with pytest.raises(ValueError, match="delta_dtype: set delta_dtype or compression"):
        DiLoCoOptions(hub_dir="x", delta_dtype="fp4", compression="bf16")
    with pytest.raises(ValueError, match="delta_dtype"):
        DiLoCoOptions(hub_dir="x", delta_dtype="fp3")  # type: ignore[arg-type]  # bad on purpose
    with pytest.raises(ValueError, match="not both"):
        CollectiveDiLoCoOptions(delta_dtype="int8", compression="fp16")
    with pytest.raises(ValueError, match="outlier_policy"):
        CollectiveDiLoCoOptions.from_mapping({"outlier_policy": "ignore"})


# -- the hub master ---------------------------------------------------------------------


def _master(
    tmp_path: Path, policy: str = "clip", *, weight_by_work: bool = True
) -> tuple[MasterLoop, ModelLayout, dict[str, torch.Tensor]]:
    MasterLoop._active.clear()
    model = nn.Linear(8, 4)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(0.5)
    state = {key: value.detach().clone() for key, value in model.state_dict().items()}
    layout = build_layout(state)
    transport = RetryingTransport(
        DirectoryTransport(tmp_path / "hub"),
        RetryPolicy(attempts=1, initial=0.001, maximum=0.001, timeout=10),
    )
    settings = MasterSettings(
        node_id="master",
        outer_lr=1.0,
        outer_momentum=0.0,
        staleness_power=0.0,
        robust=RobustSettings(policy, factor=10.0),  # type: ignore[arg-type]  # a test value
        weight_by_work=weight_by_work,
    )
    master = MasterLoop(transport, layout, settings, audit_path=tmp_path / "audit.jsonl")
    master.reconcile(state)
    return master, layout, state


def _upload(
    master: MasterLoop,
    layout: ModelLayout,
    node: str,
    step: int,
    value: float,
    *,
    tokens: int = 0,
    encoding: Encoding = Encoding.FP32,
) -> None:
    delta = {key: torch.full(layout.wire_shapes[key], value) for key in layout.sync_keys}
    info = DeltaInfo(node, step, master.outer_step, "inc", tokens=tokens)
    data = encode_delta(delta, info, layout, compression=encoding)
    master.transport.put(delta_path(node, step, parse_header(data).metadata["sha256"]), data)


def _global(master: MasterLoop) -> dict[str, torch.Tensor]:
    snapshot = master.snapshot()
    assert snapshot is not None
    return snapshot.global_state


def test_the_master_never_applies_a_1e6_delta_as_is(tmp_path: Path) -> None:
    master, layout, _ = _master(tmp_path)
    honest = [0.010, 0.012, 0.011]
    for round_index, value in enumerate(honest):  # honest rounds build the history
        _upload(master, layout, "good", round_index + 1, value)
        assert master.sync_once().published
    before = _global(master)
    _upload(master, layout, "evil", 1, 1e6)
    report = master.sync_once()
    assert report.published and report.applied[0].clip < 1e-5
    after = _global(master)
    root = layout.sync_numel**0.5
    bound = 10 * statistics.median([*honest, 1e6]) * root  # this round's norm counts too
    moved = sum(float((after[key] - before[key]).norm() ** 2) for key in layout.sync_keys)
    assert moved**0.5 == pytest.approx(bound)  # lr 1: the step is the clipped delta
    assert master.state_dict()["norm_history"] == pytest.approx(
        [value * root for value in honest] + [bound]
    )


def test_a_first_round_1e6_delta_is_bounded_by_the_model_norm(tmp_path: Path) -> None:
    master, layout, state = _master(tmp_path)
    _upload(master, layout, "evil", 1, 1e6)
    report = master.sync_once()
    assert report.published
    model_norm = sum(float(state[key].norm() ** 2) for key in layout.sync_keys) ** 0.5
    assert report.applied[0].norm * report.applied[0].clip == pytest.approx(10 * model_norm)


def test_the_reject_policy_leaves_the_outlier_on_the_hub_as_a_logged_rejection(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    master, layout, _ = _master(tmp_path, "reject")
    for round_index, value in enumerate([0.010, 0.012, 0.011]):
        _upload(master, layout, "good", round_index + 1, value)
        master.sync_once()
    before = _global(master)
    _upload(master, layout, "evil", 1, 1e6)
    _upload(master, layout, "good", 9, 0.013)  # (a new payload: not a duplicate)
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        report = master.sync_once()
    assert [item.node_id for item in report.applied] == ["good"]
    assert [item.reason for item in report.rejected] == [RejectionReason.OUTLIER]
    assert "outlier" in caplog.text and "evil" in caplog.text
    after = _global(master)
    assert torch.allclose(after["weight"], before["weight"] - 0.013)
    assert master.sync_once().rejected == ()  # reported once, not examined every round


def test_the_master_weights_deltas_by_the_tokens_they_report(tmp_path: Path) -> None:
    master, layout, state = _master(tmp_path)
    _upload(master, layout, "a", 1, 0.01, tokens=100)
    _upload(master, layout, "b", 1, 0.04, tokens=300)
    report = master.sync_once()
    assert [item.weight for item in report.applied] == [0.5, 1.5]
    expected = state["weight"] - (0.5 * 0.01 + 1.5 * 0.04) / 2
    assert torch.allclose(_global(master)["weight"], expected)


@pytest.mark.parametrize("encoding", [Encoding.INT8, Encoding.FP4])
def test_the_master_applies_low_bit_deltas_in_float32(tmp_path: Path, encoding: Encoding) -> None:
    master, layout, state = _master(tmp_path)
    _upload(master, layout, "a", 1, 0.01, encoding=encoding)
    assert master.sync_once().published
    new = _global(master)
    assert new["weight"].dtype == torch.float32
    assert torch.allclose(new["weight"], state["weight"] - 0.01, atol=1e-8)  # 0.01 is exact


# -- the node: low-bit upload with error feedback -----------------------------------------


def _node(tmp_path: Path, error_feedback: bool) -> tuple[DiLoCoNode, nn.Linear]:
    MasterLoop._active.clear()
    torch.manual_seed(0)
    model = nn.Linear(33, 3)
    layout = build_layout(model.state_dict())
    transport = RetryingTransport(
        DirectoryTransport(tmp_path / "hub"),
        RetryPolicy(attempts=1, initial=0.001, maximum=0.001, timeout=10),
    )
    master = MasterLoop(transport, layout, MasterSettings(node_id="m"))
    settings = NodeSettings(
        node_id="m",
        role="master",
        inner_steps=1,
        poll_interval=1e9,  # no master round: the upload alone is under test
        delta_dtype=Encoding.FP4,
        error_feedback=error_feedback,
    )
    return DiLoCoNode(model, transport, layout, settings, master=master), model


@pytest.mark.parametrize("error_feedback", [True, False])
def test_fp4_uploads_carry_the_rounding_residual_into_the_next_delta(
    tmp_path: Path, error_feedback: bool
) -> None:
    node, model = _node(tmp_path, error_feedback)
    node.start(0)
    assert node.wait_idle(10)
    node.record_work(0, 0)
    node.on_step(1)
    assert node.installed_step == 0  # the bootstrap global
    # Step 1 starts the master's first round in the background: let it finish before the
    # upload, or a slow round lists (applies and deletes) the delta this test reads.
    assert node.wait_idle(10)
    with torch.no_grad():
        model.weight.add_(torch.linspace(-0.3, 0.2, model.weight.numel()).view_as(model.weight))
    node.record_work(640, 32)
    node.on_step(2)
    assert node.wait_idle(10) and node.stats.uploads == 1
    sent = [item for item in (tmp_path / "hub" / "nodes" / "m").iterdir()]
    meta = parse_header(sent[0].read_bytes()).metadata
    assert (meta["encoding"], meta["tokens"], meta["samples"]) == ("fp4", "640", "32")
    if not error_feedback:
        assert node.pending is None
        return
    assert node.pending is not None and node.pending_work == (0, 0)
    layout = node.layout
    delta = {"weight": -torch.linspace(-0.3, 0.2, 99).view(3, 33), "bias": torch.zeros(3)}
    flat = flatten_delta(delta, layout)
    residual = flat - round_trip(flat, Encoding.FP4)
    assert torch.allclose(flatten_delta(node.pending, layout), residual, atol=1e-6)
    saved = node.state_dict()  # the residual is checkpointed with the unsent work
    assert saved["pending"] is node.pending
    node.stop()


# -- collective mode, one process ---------------------------------------------------------


class _Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x), y)


def _fit(tmp_path: Path, callback: CollectiveDiLoCo, steps: int, name: str) -> Trainer:
    trainer = _trainer(tmp_path, callback, name)
    trainer.fit(steps)
    return trainer


def _trainer(tmp_path: Path, callback: CollectiveDiLoCo, name: str) -> Trainer:
    model = _Regression()
    inputs = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    data = [(inputs, inputs.sum(dim=1, keepdim=True))]
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        data,
        callbacks=[callback],
        output_dir=tmp_path / name,
    )
    return trainer


def test_collective_fp4_rounds_keep_a_residual_and_a_norm_history(tmp_path: Path) -> None:
    callback = CollectiveDiLoCo(inner_steps=2, delta_dtype="fp4", outer_momentum=0.5)
    _fit(tmp_path, callback, 6, "fp4")
    assert callback.outer_steps == 3 and callback.outliers == 0
    state = callback.state_dict()
    residual = state["residual"]
    assert isinstance(residual, torch.Tensor) and residual.abs().max() > 0
    assert len(state["norm_history"]) == 3  # type: ignore[arg-type]  # a list
    restored = CollectiveDiLoCo(inner_steps=2, delta_dtype="fp4", outer_momentum=0.5)
    restored.load_state_dict(state)
    restored.checkpoint.restore(state, 6)
    assert torch.equal(restored.residual, residual)  # type: ignore[arg-type]  # set above
    assert restored.norm_history.to_list() == state["norm_history"]


def test_collective_fp4_with_error_feedback_resumes_exactly(tmp_path: Path) -> None:
    def callback() -> CollectiveDiLoCo:
        return CollectiveDiLoCo(inner_steps=2, delta_dtype="fp4", outer_momentum=0.5)

    straight = _fit(tmp_path, callback(), 8, "straight")
    first = _fit(tmp_path, callback(), 4, "first")
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = _trainer(tmp_path, callback(), "resumed")
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    resumed.fit(8)
    for name, value in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name


class _Blowup(CollectiveDiLoCo):
    """Corrupts the local weights right before the third round's exchange."""

    def outer_round(self, trainer: object) -> None:
        if self.outer_steps == 2:
            with torch.no_grad():
                for parameter in trainer.model.parameters():  # type: ignore[attr-defined]
                    parameter.add_(1e6)
        super().outer_round(trainer)  # type: ignore[arg-type]  # a TrainerView


def test_collective_mode_never_applies_a_1e6_pseudo_gradient_as_is(tmp_path: Path) -> None:
    callback = _Blowup(inner_steps=2, outer_lr=1.0, outer_momentum=0.0)
    trainer = _fit(tmp_path, callback, 6, "blowup")
    assert callback.outliers == 1
    largest = max(float(p.detach().abs().max()) for p in trainer.model.parameters())
    assert largest < 100  # clipped to 10 x the median norm, not 1e6
    rejecting = _Blowup(inner_steps=2, outer_lr=1.0, outer_momentum=0.0, outlier_policy="reject")
    trainer = _fit(tmp_path, rejecting, 6, "reject")
    assert rejecting.outliers == 1 and rejecting.outer_steps == 3
    assert max(float(p.detach().abs().max()) for p in trainer.model.parameters()) < 100


def test_unknown_encodings_and_bad_packing_on_the_hub_are_logged_rejections(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    master, layout, state = _master(tmp_path)
    delta = {key: torch.full(layout.wire_shapes[key], 0.02) for key in layout.sync_keys}
    wire = to_wire(delta, layout, Encoding.FP4)
    for node, fields, tensors in (
        ("future", {"encoding": "fp3"}, wire),
        ("short", {"encoding": "fp4"}, {"codes": wire["codes"][:-1], "scales": wire["scales"]}),
    ):
        meta = {
            "node_id": node,
            "local_step": "1",
            "base_outer_step": "0",
            "block_size": "64",
            "values": str(layout.sync_numel),
            **fields,
        }
        data = encode_file("delta", tensors, meta, fingerprint=layout.fingerprint, secret=None)
        master.transport.put(delta_path(node, 1, parse_header(data).metadata["sha256"]), data)
    _upload(master, layout, "good", 1, 0.01, encoding=Encoding.INT8)
    with caplog.at_level(logging.WARNING, logger="speedtronic.diloco"):
        report = master.sync_once()
    assert report.published and [item.node_id for item in report.applied] == ["good"]
    reasons = {item.path.split("/")[1]: item.reason for item in report.rejected}
    assert reasons == {
        "future": RejectionReason.UNKNOWN_ENCODING,
        "short": RejectionReason.BAD_PACKING,
    }
    assert "unknown_encoding" in caplog.text and "bad_packing" in caplog.text
    assert torch.allclose(_global(master)["weight"], state["weight"] - 0.01)
