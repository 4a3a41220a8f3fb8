"""The public surface: every exported name resolves, the original API names still work, and
the engine never imports the built-in callbacks package ``speedtronic_callbacks`` (plugins come
through entry points)."""

from __future__ import annotations

import subprocess
import sys
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
