"""The ``ema`` callback: the average itself (one fused device update, ``every_steps``,
``start_step``, skipped steps), its evaluation (``eval/ema/*`` beside ``eval/*``, training
undisturbed), exact resume, the published weights (``export``/``evaluate --weights ema``) and
bad options. The sharded (FSDP) shadow is tests/test_ema_fsdp.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from cli_runner import run_cli
from torch import nn
from torch.overrides import TorchFunctionMode

from speedtronic import Callback, Trainer
from speedtronic.engine.contexts import OptimizerStepContext, StepContext
from speedtronic.engine.evaluation import evaluate_model
from speedtronic.engine.view import TrainerView
from speedtronic.state.checkpoint import CheckpointManager
from speedtronic.state.published_weights import (
    PublishedWeightsError,
    apply_weights,
    published_weights,
)
from speedtronic.state.resume import resume_from
from speedtronic_callbacks.checkpoint import CheckpointCallback
from speedtronic_callbacks.early_stopping import EarlyStopping
from speedtronic_callbacks.ema import EMA, EMA_EVAL_LOSS, EMA_EVAL_PPL

torch.set_num_threads(1)

VOCAB = 11


class TinyLM(nn.Module):
    """Embedding + dropout + head: dropout makes the RNG part of an exact resume."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.head(self.drop(self.embed(input_ids)))}


def lm_batches(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (n, 2, 6), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in ids]


HELD_OUT = lm_batches(2, seed=2)


class Weights(Callback):
    """Records the trainable weights after every step's update (before any average)."""

    def __init__(self) -> None:
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, trainer: TrainerView, ctx: StepContext) -> None:
        self.after[ctx.step] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def trainer(*callbacks: Callback, steps: int = 6, eval_every: int | None = None) -> Trainer:
    torch.manual_seed(0)
    model = TinyLM()
    return Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.05),
        lm_batches(5, seed=1),
        device="cpu",
        callbacks=list(callbacks),
        max_steps=steps,
        metrics_every=1,
        eval_data=HELD_OUT if eval_every else None,
        eval_every=eval_every,
    )


def initial_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {n: p.detach().clone() for n, p in TinyLM().named_parameters()}


def expected_average(
    weights: dict[int, dict[str, torch.Tensor]],
    decay: float,
    *,
    every_steps: int = 1,
    start_step: int = 0,
) -> dict[str, torch.Tensor]:
    """The average as the docs define it, step by step, with ``torch.lerp``."""
    shadow = initial_weights()
    for step in sorted(weights):
        if step == start_step:
            shadow = {n: w.clone() for n, w in weights[step].items()}
        elif step > start_step and step % every_steps == 0:
            shadow = {n: torch.lerp(shadow[n], w, 1 - decay) for n, w in weights[step].items()}
    return shadow


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize(
    ("every_steps", "start_step"), [(1, 0), (2, 0), (2, 3)], ids=["each", "every2", "from3"]
)
def test_the_shadow_is_the_documented_average(every_steps: int, start_step: int) -> None:
    ema, weights = EMA(0.7, every_steps=every_steps, start_step=start_step), Weights()
    trainer(ema, weights, steps=7).fit()
    assert_bitwise(
        ema.shadow,
        expected_average(weights.after, 0.7, every_steps=every_steps, start_step=start_step),
    )
    lerps = [s for s in range(1, 8) if s > start_step and s % every_steps == 0]
    assert ema.updates == len(lerps)


def test_before_start_step_the_shadow_is_the_weights() -> None:
    ema, weights = EMA(0.5, start_step=10), Weights()
    run = trainer(ema, weights, steps=4, eval_every=2)
    records = run.fit().metrics
    assert not ema.live and ema.updates == 0
    assert_bitwise(ema.state_dict()["weights"], weights.after[4])  # type: ignore[arg-type]  # a dict of tensors
    for record in records:
        if "eval/loss" in record:  # the average's numbers are the model's, without a pass
            assert record[EMA_EVAL_LOSS] == record["eval/loss"]


class Calls(TorchFunctionMode):
    """The torch functions called while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]  # torch's protocol
        name = getattr(func, "__name__", str(func))
        if name != "_set_grad_enabled":  # torch.no_grad(): a flag, no tensor work
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def test_an_update_is_one_fused_call_and_a_skipped_step_none() -> None:
    ema = EMA(0.9)
    run = trainer(ema, steps=2)
    run.fit()
    before = {n: t.clone() for n, t in ema.shadow.items()}
    with Calls() as calls:  # a grad-scaler step that overflowed: nothing to average
        ema.on_after_optimizer_step(run, OptimizerStepContext(3, skipped=True))
    assert calls.names == []
    assert_bitwise(ema.shadow, before)
    with torch.no_grad():
        for p in run.model.parameters():
            p.add_(1.0)
    with Calls() as calls:  # no .item(), no .cpu(), no per-tensor op: one foreach kernel
        ema.on_after_optimizer_step(run, OptimizerStepContext(3))
    assert calls.names == ["_foreach_lerp_"]
    assert all(not torch.equal(ema.shadow[n], before[n]) for n in before)


def test_eval_ema_metrics_are_the_shadows_and_training_is_undisturbed() -> None:
    ema = EMA(0.6)
    records = trainer(ema, steps=6, eval_every=3).fit().metrics
    plain = trainer(steps=6, eval_every=3).fit().metrics
    # Swapping the shadow in for its evaluation changes nothing the run depends on.
    assert [r["loss"] for r in records] == [r["loss"] for r in plain]
    assert [r.get("eval/loss") for r in records] == [r.get("eval/loss") for r in plain]
    evaluated = [r for r in records if "eval/loss" in r]
    assert [r["step"] for r in evaluated] == [3, 6]
    assert all(EMA_EVAL_LOSS not in r for r in records if "eval/loss" not in r)
    final = evaluated[-1]
    model = TinyLM()
    apply_weights(model, ema.shadow, "ema")
    direct = evaluate_model(model, HELD_OUT, device=torch.device("cpu")).metrics
    assert final[EMA_EVAL_LOSS] == direct["eval/loss"]
    assert final[EMA_EVAL_PPL] == direct["eval/ppl"]
    assert final[EMA_EVAL_LOSS] != final["eval/loss"]  # it is another model's number
    # A monitor reads the average's loss like any evaluation key.
    watch = EarlyStopping("eval/ema/loss", patience=1, min_delta=10.0)
    stopped = trainer(EMA(0.6), watch, steps=9, eval_every=3).fit()
    assert stopped.steps == 6 and "eval/ema/loss did not improve" in str(stopped.stop_reason)
    off = EMA(0.6, evaluate=False)
    assert all(EMA_EVAL_LOSS not in r for r in trainer(off, steps=3, eval_every=3).fit().metrics)


def checkpointed(directory: Path, ema: EMA) -> Trainer:
    saver = CheckpointCallback(
        directory, every_steps=3, keep_last=None, save_on_signal=False, save_final=False
    )
    return trainer(ema, saver, steps=8, eval_every=2)


def test_an_interrupted_run_resumes_bit_exactly_with_ema(tmp_path: Path) -> None:
    whole_ema = EMA(0.8, every_steps=2, start_step=1)
    whole = trainer(whole_ema, steps=8, eval_every=2).fit().metrics
    first_ema = EMA(0.8, every_steps=2, start_step=1)
    checkpointed(tmp_path, first_ema).fit(5)  # the last checkpoint is step 3's
    resumed_ema = EMA(0.8, every_steps=2, start_step=1)
    second = checkpointed(tmp_path, resumed_ema)
    resumed = resume_from(second, CheckpointManager(tmp_path, enabled=False))
    assert resumed == tmp_path / "step_000000000003.pt"
    records = second.fit().metrics
    assert second.step == 8
    for key in ("loss", "eval/loss", EMA_EVAL_LOSS):
        assert [r.get(key) for r in records] == [r.get(key) for r in whole[3:]], key
    assert_bitwise(resumed_ema.shadow, whole_ema.shadow)
    assert resumed_ema.updates == whole_ema.updates


def test_a_shadow_that_does_not_fit_the_model_is_refused() -> None:
    ema = EMA(0.9)
    ema.load_state_dict({"weights": {"embed.weight": torch.zeros(3, 3)}, "live": True})
    fits = (
        r"trainable parameters: checkpoint does not match the model: missing keys: "
        r"head\.weight, head\.bias \| shape mismatch: embed\.weight: checkpoint \(3, 3\) vs "
        r"model \(11, 8\)$"
    )
    with pytest.raises(ValueError, match=fits):
        trainer(ema, steps=1).fit()


@pytest.mark.parametrize("decay", [0.0, 1.0, 1.5, -0.1, True])
def test_a_decay_outside_the_open_interval_is_refused(decay: float) -> None:
    with pytest.raises(ValueError, match=r"ema: decay must be in \(0, 1\)"):
        EMA(decay)


# -- through the CLI ----------------------------------------------------------------------


def run_yaml(tmp_path: Path, callbacks: list[object], steps: int = 4) -> Path:
    config = {
        "run": {"device": "cpu", "max_steps": steps, "output_dir": str(tmp_path / "run")},
        "model": {
            "name": "reference_transformer",
            "vocab_size": 32,
            "max_seq_len": 8,
            **{"n_layer": 1, "n_head": 2, "n_kv_head": 1, "d_model": 16, "d_ff": 32},
        },
        "data": {"synthetic_kind": "learnable", "num_tokens": 128, "micro_batch_size": 4},
        "optimizer": {"name": "adamw", "lr": 1e-2},
        "logging": {"console": False, "jsonl": True},
        "checkpoint": {"every_steps": 2, "keep_last": None},
        "eval": {"every_steps": 2, "max_batches": 2},
        "callbacks": callbacks,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def one_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("speedtronic: error:"), stderr
    return lines[0]


@pytest.mark.parametrize("command", ["validate", "fit"])
def test_a_bad_decay_exits_2_naming_the_key_and_value(tmp_path: Path, command: str) -> None:
    config = run_yaml(tmp_path, [{"name": "ema", "decay": 1.0}])
    result = run_cli(command, "--config", str(config), cwd=tmp_path)
    assert result.returncode == 2
    assert "callbacks[0].decay: 1.0 is greater than or equal to the maximum of 1" in one_error(
        result.stderr
    )
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_export_and_evaluate_use_the_ema_weights(tmp_path: Path) -> None:
    import transformers

    config = run_yaml(tmp_path, [{"name": "ema", "decay": 0.5}])
    assert run_cli("fit", "--config", str(config), cwd=tmp_path).returncode == 0
    final = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    # evaluate --weights ema scores the average as the run's own evaluation did
    result = run_cli("evaluate", "--config", str(config), "--weights", "ema", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"eval/loss={final[EMA_EVAL_LOSS]!r} ")
    assert result.stdout.rstrip().endswith(" weights=ema")
    for weights in ("ema", "model"):
        result = run_cli(
            *("export", "--config", str(config), "--weights", weights),
            *("--output", str(tmp_path / weights)),
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stderr
    loaded = CheckpointManager(tmp_path / "run" / "checkpoints", enabled=False)
    latest = loaded.load_latest_checkpoint()
    assert latest is not None and latest.step == 4
    shadow = published_weights(latest, "ema")
    ema_export = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ema"))
    model_export = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"))
    exported = dict(ema_export.named_parameters())
    assert torch.equal(exported["model.embed_tokens.weight"], shadow["transformer.wte.weight"])
    assert torch.equal(
        exported["model.layers.0.mlp.down_proj.weight"],
        shadow["transformer.h.0.mlp.down_proj.weight"],
    )
    trained = dict(model_export.named_parameters())["model.embed_tokens.weight"]
    assert not torch.equal(trained, exported["model.embed_tokens.weight"])


def test_weights_ema_without_ema_state_exits_2_naming_what_is_missing(tmp_path: Path) -> None:
    config = run_yaml(tmp_path, [], steps=2)
    assert run_cli("fit", "--config", str(config), cwd=tmp_path).returncode == 0
    for command in (
        ("export", "--output", str(tmp_path / "hf")),
        ("evaluate",),
    ):
        result = run_cli(
            command[0], "--config", str(config), "--weights", "ema", *command[1:], cwd=tmp_path
        )
        assert result.returncode == 2
        message = one_error(result.stderr)
        assert "--weights ema: checkpoint " in message
        assert "holds no 'ema' weights (it has no state for a callback with state_key 'ema'" in (
            message
        )
        assert message.endswith("Weights it holds: model")
    assert not (tmp_path / "hf").exists()
    latest = CheckpointManager(tmp_path / "run" / "checkpoints", enabled=False)
    checkpoint = latest.load_latest_checkpoint()
    assert checkpoint is not None
    with pytest.raises(PublishedWeightsError):
        published_weights(checkpoint, "ema")
