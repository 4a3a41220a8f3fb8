"""``speedtronic.Trainer`` is the engine's Trainer (issue 33, docs/architecture.md): it takes
the settings as keywords, holds the run's config, and reaches 2.0's constructor arguments and
members through ``speedtronic.engine.compat_route`` -- so a run that uses none of 2.0 never
loads ``speedtronic.compat``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import speedtronic
from speedtronic.engine.evaluation import Evaluation
from speedtronic.engine.keywords import resolve_settings
from speedtronic.engine.settings import TrainerSettings
from speedtronic.engine.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent


def parts() -> tuple[nn.Module, torch.optim.Optimizer, list[tuple[torch.Tensor, ...]]]:
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    batches: list[tuple[torch.Tensor, ...]] = [(torch.randn(4, 2),) for _ in range(3)]
    return model, torch.optim.SGD(model.parameters(), lr=0.1), batches


def _run(code: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


def test_the_public_trainer_is_the_engine_trainer() -> None:
    import speedtronic.trainer
    from speedtronic import SpeedtronicTrainer, TrainingEngine

    assert speedtronic.Trainer is Trainer
    assert speedtronic.trainer.Trainer is Trainer
    assert TrainingEngine is Trainer and SpeedtronicTrainer is Trainer


def test_a_modern_run_never_loads_the_2_0_layer(tmp_path: Path) -> None:
    """Keywords, a fit, a runtime-built run: no module of ``speedtronic.compat`` is loaded
    until 2.0's ``trainer.logger`` is read."""
    config = {
        "run": {"device": "cpu", "max_steps": 2, "output_dir": str(tmp_path / "run")},
        "model": {"vocab_size": 32, "max_seq_len": 8, "n_layer": 1, "n_head": 4, "d_model": 32},
        "data": {"num_tokens": 32, "micro_batch_size": 2},
        "scheduler": {"warmup_steps": 0},
        "logging": {"console": False},
    }
    _run(
        "import sys, torch, speedtronic\n"
        "from torch import nn\n"
        "def compat():\n"
        "    return sorted(m for m in sys.modules if m.startswith('speedtronic.compat'))\n"
        "model = nn.Linear(2, 1)\n"
        "data = [(torch.ones(2, 2),)]\n"
        "trainer = speedtronic.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data,\n"
        f"    device='cpu', metrics_every=2, grad_clip=1.0, output_dir={str(tmp_path)!r},\n"
        "    eval_data=data, eval_every=1, parallel={'strategy': 'ddp'}, max_steps=2)\n"
        "assert trainer.fit().steps == 2\n"
        f"built, _ = speedtronic.build_runtime({config!r})\n"
        "built.fit()\n"
        "assert compat() == [], compat()\n"
        "assert built.logger is not None  # 2.0's member: the 2.0 layer loads now\n"
        "assert 'speedtronic.compat.trainer' in compat()\n"
    )


def test_the_settings_keywords_replace_values_of_the_settings() -> None:
    model, optimizer, data = parts()
    base = TrainerSettings(accumulation_steps=2, metrics_every=5)
    trainer = Trainer(
        model, optimizer, data, settings=base, metrics_every=3, grad_clip=0.5, output_dir="out"
    )
    settings = trainer.settings
    assert (settings.accumulation_steps, settings.metrics_every) == (2, 3)
    assert settings.grad_clip == 0.5 and settings.output_dir == Path("out")
    assert trainer.metrics_every == 3 and trainer.grad_clip == 0.5
    assert Trainer(model, optimizer, data).settings == TrainerSettings()
    # parallel= as a section object (a ParallelConfig's attributes) or a mapping
    section = SimpleNamespace(strategy="FSDP", reshard_after_forward=False, tensor=2)
    for parallel in (section, {"strategy": "FSDP", "reshard_after_forward": False, "tensor": 2}):
        resolved = resolve_settings(base, None, {"parallel": parallel})
        assert (resolved.parallel, resolved.reshard_after_forward, resolved.tensor) == (
            "fsdp",
            False,
            2,
        )


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        ({"strategy": "pipeline"}, "parallel.strategy must be 'ddp' or 'fsdp', got 'pipeline'"),
        ({"tensor": 0}, "parallel.tensor must be a positive integer, got 0"),
        ({"shards": 2}, "parallel: unknown key 'shards'"),
    ],
)
def test_a_bad_parallel_keyword_is_named(parallel: dict[str, object], message: str) -> None:
    model, optimizer, data = parts()
    with pytest.raises(ValueError, match=message):
        Trainer(model, optimizer, data, parallel=parallel)


def test_a_misspelt_keyword_or_member_is_an_error_as_on_any_class() -> None:
    model, optimizer, data = parts()
    with pytest.raises(TypeError, match="unexpected keyword argument 'metrics_evry'"):
        Trainer(model, optimizer, data, metrics_evry=3)  # type: ignore[call-overload]
    trainer = Trainer(model, optimizer, data)
    with pytest.raises(AttributeError, match="has no attribute 'loger'"):
        trainer.loger  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(TypeError, match="evaluation= or eval_every=, not both"):
        Trainer(model, optimizer, data, evaluation=Evaluation(), eval_every=2)


def test_a_2_0_argument_builds_the_2_0_trainer_once() -> None:
    from speedtronic.compat.metric_logger import MetricLogger, MetricLoggerCallback
    from speedtronic.compat.trainer import V2Trainer

    model, optimizer, data = parts()
    logger = MetricLogger(echo=False)
    trainer = speedtronic.Trainer(model, optimizer, data, logger=logger, metrics_every=2)
    assert type(trainer) is V2Trainer and isinstance(trainer, speedtronic.Trainer)
    assert trainer.logger is logger and trainer.metrics_every == 2
    adapters = [cb for cb in trainer.callbacks if isinstance(cb, MetricLoggerCallback)]
    assert [cb.logger for cb in adapters] == [logger]  # __init__ ran once: one adapter

    class Mine(Trainer):
        pass

    with pytest.raises(TypeError, match="logger= is 2.0's"):
        Mine(model, optimizer, data, logger=logger)


def test_2_0_members_of_a_trainer_built_without_2_0_arguments(tmp_path: Path) -> None:
    from speedtronic.compat.metric_logger import MetricLogger, MetricLoggerCallback

    model, optimizer, data = parts()
    trainer = Trainer(model, optimizer, data, max_steps=2)
    assert trainer.train.__func__ is Trainer.fit  # type: ignore[attr-defined]
    state = trainer.state_dict()
    trainer.train()  # type: ignore[attr-defined]
    assert trainer.step == 2
    trainer.resume(state)  # type: ignore[attr-defined]
    assert trainer.step == 0
    built = MetricLogger(echo=False)
    trainer.provide_logger(lambda: built)  # type: ignore[attr-defined]
    assert [cb for cb in trainer.callbacks if isinstance(cb, MetricLoggerCallback)] == []
    assert trainer.logger is built and trainer.logger is built  # type: ignore[attr-defined]
    adapters = [cb for cb in trainer.callbacks if isinstance(cb, MetricLoggerCallback)]
    assert [cb.logger for cb in adapters] == [built]


def test_the_config_a_trainer_holds_is_what_checkpoints_record() -> None:
    from speedtronic.config import SpeedtronicConfig

    model, optimizer, data = parts()
    trainer = Trainer(model, optimizer, data)
    assert trainer.config is None and trainer.run_config is None
    config = SpeedtronicConfig.from_dict({"run": {"name": "held"}})
    trainer.config = config
    assert trainer.config is config
    assert trainer.run_config == config.to_dict(redact_secrets=True)
    trainer.config = None
    assert trainer.run_config is None
