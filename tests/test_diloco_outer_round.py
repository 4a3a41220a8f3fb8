"""The outer round both DiLoCo modes run (``outer_round.OuterRound``): judge, weighting
policies, outer step, and that the hub master and the collective callback hold it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speedtronic_callbacks.diloco.aggregation import NormHistory, RobustSettings
from speedtronic_callbacks.diloco.collective import CollectiveDiLoCo
from speedtronic_callbacks.diloco.directory_transport import DirectoryTransport
from speedtronic_callbacks.diloco.master import MasterLoop, MasterSettings
from speedtronic_callbacks.diloco.math import NesterovOuterOptimizer
from speedtronic_callbacks.diloco.model_layout import build_layout
from speedtronic_callbacks.diloco.outer_round import (
    Contribution,
    KeptAverage,
    OuterRound,
    ReplicaAverage,
    replica_coefficients,
    share_by_work,
)


def test_kept_average_weighs_staleness_times_share_times_clip() -> None:
    policy = KeptAverage(staleness_power=0.5)
    weights = policy.weights(
        [Contribution(1.0, staleness=3, clip=0.5, share=2.0), Contribution(1.0)]
    )
    assert weights == [0.5, 1.0]  # (1 + 3) ** -0.5 x 2 x 0.5; a fresh, whole delta: 1
    assert policy.name == "kept_average"


def test_replica_average_rescales_the_kept_and_zeroes_the_left_out() -> None:
    policy = ReplicaAverage()
    kept_two = [
        Contribution(1.0, share=0.5),
        Contribution(1e6, clip=0.0),
        Contribution(1.0, share=1.5),
    ]
    assert policy.weights(kept_two) == pytest.approx([0.75, 0.0, 2.25])  # x 3 / 2
    assert policy.weights([Contribution(1.0), Contribution(2.0)]) == [1.0, 1.0]  # exactly
    assert policy.weights([Contribution(1.0, clip=0.0)] * 2) == [0.0, 0.0]


def test_both_policies_average_the_same_kept_pseudo_gradients() -> None:
    """What differs is only the transport's divisor: the hub drops a left-out delta and
    divides by the kept count, the all-reduce divides by every replica."""
    deltas = [torch.tensor([1.0, 2.0]), torch.tensor([100.0, 100.0]), torch.tensor([3.0, -1.0])]
    clips = [1.0, 0.0, 0.5]
    tokens, samples = [10, 10, 30], [1, 1, 1]
    replicas = [Contribution(1.0, clip=clip) for clip in clips]
    share_by_work(replicas, tokens, samples)
    coefficients = ReplicaAverage().weights(replicas)
    all_reduced = sum(c * d for c, d in zip(coefficients, deltas, strict=True)) / len(deltas)
    kept = [i for i, clip in enumerate(clips) if clip > 0]
    hub = [Contribution(1.0, clip=clips[i], share=replicas[i].share) for i in kept]
    weights = KeptAverage(staleness_power=0.5).weights(hub)
    averaged = sum(w * deltas[i] for w, i in zip(weights, kept, strict=True)) / len(kept)
    assert torch.allclose(all_reduced, averaged)
    assert [c.share for c in replicas] == [0.5, 1.0, 1.5]  # the left-out one keeps 1


def test_judge_sets_the_clips_and_the_history_moves_only_when_recorded() -> None:
    outer = OuterRound(RobustSettings("reject"), ReplicaAverage(), lr=1.0, momentum=0.0)
    outer.record("0/2", [1.0, 1.0, 1.0])
    contributions = [Contribution(1.0), Contribution(1e6), Contribution(1.2)]
    screening = outer.judge("0/2", contributions, {}, None)
    assert [c.clip for c in contributions] == [1.0, 0.0, 1.0]
    assert outer.history("0/2").to_list() == [1.0, 1.0, 1.0]  # judged, not recorded
    assert outer.history("").to_list() == []  # another fragment's history
    outer.record("0/2", screening.applied_norms([c.norm for c in contributions]))
    assert outer.history("0/2").to_list() == [1.0, 1.0, 1.0, 1.0, 1.2]


def test_a_short_history_is_bounded_by_the_global_entries_of_the_fragment() -> None:
    outer = OuterRound(RobustSettings("clip", factor=2.0), KeptAverage(0.0), lr=1.0, momentum=0.0)
    global_state = {"a": torch.full((4,), 0.5), "b": torch.full((4,), 100.0)}
    contributions = [Contribution(5.0)]
    screening = outer.judge("1/2", contributions, global_state, ["a"])
    assert screening.bound == pytest.approx(2.0)  # 2 x |a| = 2 x 1; "b" is not the fragment's
    assert contributions[0].clip == pytest.approx(2.0 / 5.0)


def test_stepped_moves_copies_and_step_moves_in_place_to_the_same_bits() -> None:
    outer = OuterRound(RobustSettings(), KeptAverage(0.5), lr=0.7, momentum=0.9)
    global_state = {"w": torch.tensor([1.0, 2.0, 3.0]), "frozen": torch.tensor([9.0])}
    momentum = {"w": torch.tensor([0.1, 0.0, -0.1])}
    combined = {"w": torch.tensor([0.5, -0.5, 0.25])}
    before = {key: value.clone() for key, value in global_state.items()}
    new_global, new_momentum = outer.stepped(global_state, momentum, combined)
    assert torch.equal(global_state["w"], before["w"])  # the published state stays
    assert torch.equal(momentum["w"], torch.tensor([0.1, 0.0, -0.1]))
    assert new_global["frozen"] is global_state["frozen"]  # untouched entries are shared
    assert outer.optimizer.buffers == {}

    outer.optimizer.buffers = {key: value.clone() for key, value in momentum.items()}
    outer.step(global_state, combined)
    assert torch.equal(global_state["w"], new_global["w"])
    assert torch.equal(outer.optimizer.buffers["w"], new_momentum["w"])
    reference = NesterovOuterOptimizer(0.7, 0.9)
    reference.buffers = {"w": torch.tensor([0.1, 0.0, -0.1])}
    expected = dict(before)
    reference.step(expected, combined)
    assert torch.equal(expected["w"], new_global["w"])


def test_replica_coefficients_are_the_replica_average_of_the_screening() -> None:
    history = NormHistory(8, [1.0, 1.0, 1.0])
    coefficients, screening = replica_coefficients(
        [1.0, 30.0, 1.0],
        [10, 10, 30],
        [1, 1, 1],
        history,
        RobustSettings("clip"),
        weight_by_work=True,
    )
    replicas = [
        Contribution(norm, clip=factor)
        for norm, factor in zip([1.0, 30.0, 1.0], screening.factors, strict=True)
    ]
    share_by_work(replicas, [10, 10, 30], [1, 1, 1])
    assert coefficients == ReplicaAverage().weights(replicas)
    assert 0 < coefficients[1] < coefficients[0]  # clipped, still part of the round


def test_the_master_and_the_collective_callback_hold_one_outer_round(tmp_path: Path) -> None:
    MasterLoop._active.clear()
    layout = build_layout({"w": torch.zeros(4)})
    settings = MasterSettings(node_id="m", outer_lr=0.5, outer_momentum=0.25, staleness_power=2.0)
    master = MasterLoop(DirectoryTransport(tmp_path / "hub"), layout, settings)
    assert isinstance(master.round, OuterRound)
    assert master.round.weighting == KeptAverage(staleness_power=2.0)
    assert (master.round.optimizer.lr, master.round.optimizer.momentum) == (0.5, 0.25)
    assert master.intake.round is master.round

    collective = CollectiveDiLoCo(inner_steps=2, outer_lr=0.5, outer_momentum=0.25)
    assert isinstance(collective.round.weighting, ReplicaAverage)
    assert collective.replicas.round is collective.round
    assert (collective.round.optimizer.lr, collective.round.optimizer.momentum) == (0.5, 0.25)
