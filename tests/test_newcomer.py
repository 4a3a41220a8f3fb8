"""What a newcomer hits first (issue 15): CPU threads, custom models and data from YAML,
``plugins``/``schema`` with ``--config``, the model summary, ``seed_everything`` and the
messages (YAML errors, W&B without a login, a DiLoCo worker before its master, errors
every rank raises). CLI behaviour runs in-process (``speedtronic.cli.main``)."""

from __future__ import annotations

import json
import logging
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

import speedtronic
from speedtronic.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from speedtronic.config import ConfigError, load_config
from speedtronic.data import collate_batch, resolve_collate
from speedtronic.models.summary import format_model_summary, summarize_model
from speedtronic.models.transformer import ReferenceTransformer
from speedtronic.runtime import AUTO_THREADS_MAX_PARAMETERS, choose_threads
from speedtronic.user_imports import search_dirs

CPU = torch.device("cpu")

PLUGIN_MODULE = '''
import torch
from torch import nn
from torch.utils.data import Dataset

from speedtronic import Callback, register_callback, register_model
from speedtronic.data import register_collate, register_dataset


@register_model(
    "newcomer_mlp",
    options_schema={
        "type": "object",
        "properties": {"hidden": {"type": "integer", "minimum": 1}},
        "required": ["hidden"],
        "additionalProperties": False,
    },
)
class Regressor(nn.Module):
    def __init__(self, *, hidden, **_):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, 1)

    def forward(self, features, target, weight=None):
        loss = (self.head(self.body(features)).squeeze(-1) - target) ** 2
        return (loss * weight).mean() if weight is not None else loss.mean()


class Pairs(Dataset):
    """(features, target) tuples, the target a float."""

    def __len__(self):
        return 6

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(index)
        features = torch.randn(4, generator=generator)
        return features, float(features.sum())


class Records(Pairs):
    """Mappings with keys of their own."""

    def __getitem__(self, index):
        features, target = super().__getitem__(index)
        return {"features": features, "target": target, "weight": 1.0}


@register_dataset("newcomer_pairs")
def pairs(request):
    return Pairs()


@register_dataset("newcomer_records")
def records(request):
    return Records()


SEEN = []


@register_collate("newcomer_counting")
def counting(items):
    SEEN.append(len(items))
    return {
        "features": torch.stack([item["features"] for item in items]),
        "target": torch.tensor([item["target"] for item in items]),
    }


@register_dataset("newcomer_declared", collate="newcomer_counting")
def declared(request):
    return Records()


@register_callback("newcomer_hello")
class Hello(Callback):
    options_schema = {
        "type": "object",
        "properties": {"greeting": {"type": "string"}},
        "additionalProperties": False,
    }

    @classmethod
    def from_options(cls, options, context):
        return cls()
'''


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A project folder holding the plugin module ``newcomer_plugins`` (found through the
    config's directory, as ``imports:`` does for a user), imported fresh for the test."""
    (tmp_path / "newcomer_plugins.py").write_text(PLUGIN_MODULE)
    monkeypatch.delitem(sys.modules, "newcomer_plugins", raising=False)
    with search_dirs(tmp_path):
        yield tmp_path
    sys.modules.pop("newcomer_plugins", None)
    from speedtronic.data import collate_registry, dataset_registry
    from speedtronic.models.registry import registry
    from speedtronic.plugins import callback_registry

    registry.unregister("newcomer_mlp")
    for name in ("newcomer_pairs", "newcomer_records", "newcomer_declared"):
        dataset_registry.unregister(name)
    collate_registry.unregister("newcomer_counting")
    callback_registry.unregister("newcomer_hello")


def plugin_config(folder: Path, **data: object) -> Path:
    config = {
        "imports": ["newcomer_plugins"],
        "run": {"device": "cpu", "max_steps": 3, "output_dir": str(folder / "out")},
        "model": {"name": "newcomer_mlp", "d_model": 30, "options": {"hidden": 5}},
        "data": {"micro_batch_size": 2, **data},
        "optimizer": {"lr": 0.01},
        "scheduler": {"warmup_steps": 0},
        "logging": {"jsonl": False},
        "checkpoint": {"enabled": False},
    }
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# -- item 7: run.threads --------------------------------------------------------------------


def test_auto_threads_is_one_for_a_small_cpu_model_and_default_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert choose_threads("auto", CPU, 10_000) == (1, "auto")
    assert choose_threads("auto", CPU, AUTO_THREADS_MAX_PARAMETERS) == (None, "auto, large model")
    assert choose_threads("auto", torch.device("cuda", 0), 10) == (None, "auto, cuda")
    assert choose_threads(3, CPU, 10) == (3, "run.threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert choose_threads("auto", CPU, 10) == (None, "OMP_NUM_THREADS")


def test_threads_is_schema_validated() -> None:
    assert load_config({"run": {"threads": 2}}).run.threads == 2
    assert load_config({}).run.threads == "auto"
    for bad in (0, "many", 1.5, True):
        with pytest.raises(ConfigError, match="run.threads"):
            load_config({"run": {"threads": bad}})


# -- item 8: model.options, the reference rules, collate ------------------------------------


def test_reference_rules_apply_to_the_reference_transformer_only(plugin_dir: Path) -> None:
    with pytest.raises(ConfigError, match="d_model: 30 is not divisible"):
        load_config({"model": {"d_model": 30}})
    with pytest.raises(ConfigError, match=r"model.options.hidden: unknown key"):
        load_config({"model": {"options": {"hidden": 3}}})  # the reference takes none
    config = load_config(plugin_config(plugin_dir))  # d_model 30, n_head 8: not its rules
    assert config.model.options == {"hidden": 5}
    with pytest.raises(ConfigError, match=r"model.options.hidden: 0 is less than the minimum"):
        load_config(plugin_config(plugin_dir), ["model.options.hidden=0"])
    with pytest.raises(ConfigError, match="'hidden' is a required property"):
        load_config(plugin_config(plugin_dir), ["model.options={}"])


@pytest.mark.parametrize(
    ("dataset", "collate"),
    [("newcomer_pairs", "auto"), ("newcomer_records", "auto"), ("newcomer_records", "default")],
)
def test_a_plugin_model_trains_from_the_cli_on_tuples_and_own_records(
    plugin_dir: Path, dataset: str, collate: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = plugin_config(plugin_dir, dataset=dataset, collate=collate)
    assert main(["fit", "--config", str(path)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "completed steps=3 samples=6" in out
    assert "| threads 1 (auto) |" in out  # a 26-parameter model: one thread
    assert "  body    Sequential" in out and "  head    Linear" in out  # the model summary


def test_a_dataset_plugin_declares_its_collate(
    plugin_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = plugin_config(plugin_dir, dataset="newcomer_declared")
    assert main(["fit", "--config", str(path)]) == EXIT_OK
    assert sys.modules["newcomer_plugins"].SEEN == [2, 2, 2]
    capsys.readouterr()
    with pytest.raises(Exception, match="unknown collate 'nope'"):
        resolve_collate("nope")


def test_auto_collate_stacks_records_and_numbers() -> None:
    batch = collate_batch([{"x": torch.ones(2), "y": 1.5}, {"x": torch.zeros(2), "y": 2.5}])
    assert isinstance(batch, dict) and batch["x"].shape == (2, 2)
    assert batch["y"].tolist() == [1.5, 2.5]
    with pytest.raises(ValueError, match="has keys"):
        collate_batch([{"x": 1}, {"y": 2}])


# -- item 9: plugins and schema with --config -----------------------------------------------


def test_plugins_and_schema_include_the_configs_imports(
    plugin_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = plugin_config(plugin_dir)
    assert main(["plugins", "--config", str(path)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "newcomer_mlp             registered in newcomer_plugins\n    options: hidden" in out
    assert "newcomer_declared" in out and "newcomer_counting" in out
    assert "newcomer_hello           registered in newcomer_plugins\n    options: greeting" in out
    assert main(["schema", "--config", str(path)]) == EXIT_OK
    schema = json.loads(capsys.readouterr().out)
    entries = schema["properties"]["callbacks"]["items"]["allOf"]
    hello = next(e for e in entries if e["if"]["properties"]["name"]["const"] == "newcomer_hello")
    assert hello["then"]["properties"]["greeting"] == {"type": "string"}
    models = schema["properties"]["model"]["allOf"]
    mlp = next(e for e in models if e["if"]["properties"]["name"]["const"] == "newcomer_mlp")
    assert mlp["then"]["properties"]["options"]["required"] == ["hidden"]


# -- item 10: messages ----------------------------------------------------------------------


def test_a_yaml_syntax_error_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("run:\n  seed: [1\n")
    assert main(["validate", "--config", str(path)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f'in "{path}", line 2' in err and "<unicode string>" not in err


def test_wandb_without_a_login_says_what_to_do_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import wandb

    from speedtronic_callbacks.wandb import WandbCallback

    def no_login(**_: object) -> None:
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", no_login)
    sink = WandbCallback(directory=tmp_path)
    trainer = SimpleNamespace(output_dir=tmp_path, run_config=None)
    with pytest.raises(RuntimeError, match="WANDB_MODE=offline") as raised:
        sink.on_setup(trainer, None)  # type: ignore[arg-type]  # the hook reads two members
    assert "wandb login" in str(raised.value)
    sink.write_record(trainer, {"step": 1, "loss": 1.0})  # type: ignore[arg-type]  # no 2nd error


def test_a_worker_before_its_master_waits_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from speedtronic_callbacks.diloco.directory_transport import DirectoryTransport
    from speedtronic_callbacks.diloco.lanes import ErrorReporter
    from speedtronic_callbacks.diloco.transport_base import HubNotCreatedError

    transport = DirectoryTransport(tmp_path / "not-yet")
    with pytest.raises(HubNotCreatedError) as raised:
        transport.get("global/pointer.json")
    with caplog.at_level(logging.INFO, logger="speedtronic"):
        ErrorReporter(logging.getLogger("speedtronic.test")).failure(
            "poll", raised.value, permanent=True
        )
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "waiting for the master" in caplog.text and "failed permanently" not in caplog.text


def test_an_error_every_rank_raises_prints_on_rank_zero_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import speedtronic.cli as cli
    from speedtronic.systems.distributed import SameOnEveryRankError

    def refuse(args: object) -> int:
        raise SameOnEveryRankError("diloco mode 'hub' ... torchrun")

    monkeypatch.setitem(cli._COMMANDS, "plot", refuse)
    monkeypatch.setattr(cli, "_RANK_ZERO_REPORTS_WITHIN_S", 0.0)  # no launcher to wait for
    monkeypatch.setenv("RANK", "1")
    assert main(["plot", str(tmp_path)]) == EXIT_FAILED
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(["plot", str(tmp_path)]) == EXIT_FAILED
    assert capsys.readouterr().err.count("diloco mode 'hub'") == 1


def test_a_user_mistake_every_rank_raises_exits_2_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A refused setting (a ``ShardingError``) is a user mistake on rank 1 too: exit 2, so
    the launcher reports 2 whichever rank ends first; rank 0 alone prints it."""
    import speedtronic.cli as cli
    from speedtronic.systems.tensor_parallel import TensorParallelError

    def refuse(args: object) -> int:
        raise TensorParallelError("parallel.tensor: 2 does not divide the world size (3)")

    monkeypatch.setitem(cli._COMMANDS, "plot", refuse)
    monkeypatch.setattr(cli, "_RANK_ZERO_REPORTS_WITHIN_S", 0.0)
    monkeypatch.setenv("RANK", "1")
    assert main(["plot", str(tmp_path)]) == EXIT_USAGE
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(["plot", str(tmp_path)]) == EXIT_USAGE
    assert capsys.readouterr().err == (
        "speedtronic: error: parallel.tensor: 2 does not divide the world size (3)\n"
    )


def test_diloco_hub_mode_refusal_under_torchrun_is_the_same_on_every_rank(tmp_path: Path) -> None:
    from speedtronic.config import SpeedtronicConfig
    from speedtronic.engine.contexts import FitContext
    from speedtronic.plugins import PluginContext, build_callback
    from speedtronic.systems.distributed import SameOnEveryRankError

    config = SpeedtronicConfig.from_dict(
        {"callbacks": [{"name": "diloco", "hub_dir": str(tmp_path / "hub"), "role": "master"}]}
    )
    spec = config.callbacks[0]
    context = PluginContext(config=config, output_dir=tmp_path, device=CPU)
    callback = build_callback(spec.name, spec.options, context)
    with pytest.raises(SameOnEveryRankError, match="mode: collective"):
        callback.on_setup(SimpleNamespace(multi_rank=True), FitContext(0, 10))  # type: ignore[arg-type]  # the hook reads multi_rank first


def test_the_start_line_shows_world_size_and_strategy() -> None:
    from speedtronic.engine.contexts import FitContext
    from speedtronic_callbacks.console import describe_fit_start

    trainer = SimpleNamespace(
        model=torch.nn.Linear(2, 2),
        device=CPU,
        precision_mode="fp32",
        accumulation_steps=1,
        run_config={"run": {"threads": 2}},
        distributed=SimpleNamespace(world_size=4, backend="gloo"),
    )
    line = describe_fit_start(trainer, FitContext(0, 5))  # type: ignore[arg-type]  # duck
    threads = torch.get_num_threads()
    assert f"| device cpu | threads {threads} | world 4 (ddp, gloo) | precision fp32 |" in line
    trainer.run_config = {
        "run": {"threads": "auto"},
        "callbacks": [{"name": "diloco", "mode": "collective", "ranks_per_replica": 2}],
    }
    line = describe_fit_start(trainer, FitContext(0, 5))  # type: ignore[arg-type]  # duck
    assert f"| threads {threads} (auto) | world 4 (diloco, 2 replicas, gloo) |" in line


# -- item 12: seed_everything, the model summary --------------------------------------------


def test_seed_everything_is_public_and_seeds_every_generator() -> None:
    def draw() -> tuple[float, float, float]:
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    assert speedtronic.seed_everything(7) == 7
    first = draw()
    speedtronic.seed_everything(7)
    assert draw() == first
    speedtronic.seed_everything(np.int64(7))  # type: ignore[arg-type]  # NumPy ints work too
    assert draw() == first
    with pytest.raises(TypeError):
        speedtronic.seed_everything("7")  # type: ignore[arg-type]  # the check under test


def test_model_summary_counts_each_module_and_shared_weights_once() -> None:
    model = ReferenceTransformer(vocab_size=16, block_size=8, n_layer=1, n_head=2, d_model=8)
    model.lm_head.weight.requires_grad_(False)  # tied: the embedding freezes with it
    rows = summarize_model(model)
    assert [row.name for row in rows] == ["transformer", "rotary", "lm_head", "total"]
    total = sum(p.numel() for p in model.parameters())
    assert sum(row.parameters for row in rows[:-1]) == rows[-1].parameters == total
    assert rows[2].parameters == 0  # lm_head shares the embedding's weight
    assert rows[-1].trainable == total - 16 * 8
    table = format_model_summary(rows).splitlines()
    assert table[0].split() == ["module", "type", "params", "trainable", "dtype"]
    assert table[-1].split()[-1] == "float32"


def test_validate_prints_the_model_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {
        "run": {"device": "cpu", "max_steps": 4, "output_dir": str(tmp_path / "o")},
        "model": {"vocab_size": 32, "max_seq_len": 8, "n_layer": 1, "n_head": 2, "d_model": 16},
        "scheduler": {"warmup_steps": 1},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["validate", "--config", str(path)]) == EXIT_OK
    out = capsys.readouterr().out
    summary = out.split("# model summary (parameters per top-level module):\n")[1]
    lines = summary.splitlines()
    assert lines[0].split() == ["#", "module", "type", "params", "trainable", "dtype"]
    assert lines[1].split()[:3] == ["#", "transformer", "ModuleDict"]
    total = ReferenceTransformer(vocab_size=32, block_size=8, n_layer=1, n_head=2, d_model=16)
    count = sum(p.numel() for p in total.parameters())
    assert lines[4].split()[:4] == ["#", "total", "ReferenceTransformer", f"{count:,}"]
