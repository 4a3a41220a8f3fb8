"""The public surface: every exported name resolves, the original API names still work, and
the engine never imports the built-in callbacks package ``speedtronic_callbacks`` (plugins come
through entry points)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import speedtronic
from speedtronic.compat.exports import kept_names

ROOT = Path(__file__).resolve().parent.parent


def test_every_exported_name_resolves() -> None:
    for name in speedtronic.__all__:
        assert getattr(speedtronic, name) is not None, name


def test_original_api_names_keep_working() -> None:
    for name in (
        "SpeedtronicConfig",
        "Trainer",
        "register_model",
        "build_model",
        "ModelRegistry",
        "build_runtime",
        "train_from_config",
        "build_dataloader",
        "set_gradient_checkpointing",
        "CheckpointManager",
        "SyncCoordinator",
        "HubClient",
        "MetricLogger",
        "WandbHook",
        "TensorboardHook",
    ):
        assert name in speedtronic.__all__ or name in kept_names()
        assert callable(getattr(speedtronic, name)) or isinstance(
            getattr(speedtronic, name), type
        ), name


def test_original_module_path_of_stage_streams_keeps_working() -> None:
    from speedtronic import scheduling
    from speedtronic.systems import stage_streams

    assert scheduling.StageStreamScheduler is stage_streams.StageStreamScheduler
    assert scheduling.StageInfo is stage_streams.StageInfo


def test_engine_modules_never_import_callbacks() -> None:
    engine = sorted(
        "speedtronic." + ".".join(path.relative_to(ROOT / "speedtronic").with_suffix("").parts)
        for path in (ROOT / "speedtronic").rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py")
    )
    code = (
        "import importlib, sys\n"
        f"for name in {engine!r}:\n"
        "    importlib.import_module(name)\n"
        "builtins = ('callbacks', 'speedtronic_callbacks')\n"
        # The hf extra too: the core imports transformers & co. only inside its functions.
        "builtins += ('transformers', 'safetensors', 'tokenizers')\n"
        "leaked = sorted(m for m in sys.modules if m.split('.')[0] in builtins)\n"
        "print(leaked)\n"
        "raise SystemExit(1 if leaked else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_trainer_imports_no_config_machinery() -> None:
    """``import speedtronic; speedtronic.Trainer`` (and the engine's Trainer) load neither
    ``jsonschema``, YAML nor ``speedtronic.config``: those cost start-up time and belong to
    reading a config (``benchmarks/import_cost.py`` measures the rest)."""
    code = (
        "import sys\n"
        "import speedtronic\n"
        "speedtronic.Trainer\n"
        "from speedtronic.engine.trainer import Trainer\n"
        "machinery = ('jsonschema', 'yaml', 'speedtronic.config')\n"
        "print(sorted(m for m in sys.modules if m.startswith(machinery)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# What ``import speedtronic; speedtronic.Trainer`` and a fit on in-memory data leave unloaded:
# the token-shard, mixture and remote-shard readers (and ``filelock``), checkpoint storage
# (sharded DCP tensors, the callbacks' shards, the run directory's lock and identity),
# tensor parallelism, the shape check, the out-of-memory recovery and the options/user-module
# machinery of plugins. Each loads with the feature that uses it.
NOT_ON_THE_TRAINING_PATH = (
    "filelock",
    "speedtronic.data.loader",
    "speedtronic.data.windows",
    "speedtronic.data.shards",
    "speedtronic.data.remote_shards",
    "speedtronic.data.shard_cache",
    "speedtronic.data.shard_lock",
    "speedtronic.data.mixture",
    "speedtronic.data.tokenizer",
    "speedtronic.data.text",
    "speedtronic.state.checkpoint",
    "speedtronic.state.sharded_checkpoint",
    "speedtronic.state.callback_shards",
    "speedtronic.state.dcp_io",
    "speedtronic.state.archive",
    "speedtronic.state.run_identity",
    "speedtronic.state.run_lock",
    "speedtronic.systems.tensor_parallel",
    "speedtronic.systems.shapes",
    "speedtronic.engine.oom_retry",
    "speedtronic.util.options",
    "speedtronic.user_imports",
)


def test_the_trainer_loads_only_what_training_on_in_memory_data_needs() -> None:
    """A fresh interpreter imports the Trainer, then builds one and fits it for two steps on a
    list of batches; neither loads a module of ``NOT_ON_THE_TRAINING_PATH``."""
    code = textwrap.dedent(
        f"""
        import sys
        import torch
        import speedtronic

        speedtronic.Trainer
        print(sorted(m for m in {NOT_ON_THE_TRAINING_PATH!r} if m in sys.modules))

        class Loss(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = torch.nn.Linear(2, 1)

            def forward(self, x):
                return self.inner(x).pow(2).mean()

        net = Loss()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        data = [{{"x": torch.ones(4, 2)}}, {{"x": torch.zeros(4, 2)}}]
        result = speedtronic.Trainer(net, opt, data, device="cpu", max_steps=2).fit()
        assert result.steps == 2, result
        print(sorted(m for m in {NOT_ON_THE_TRAINING_PATH!r} if m in sys.modules))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "[]"], done.stdout
