"""The front door (issue 33, docs/architecture.md): ``speedtronic.__all__`` is the modern API;
every other name ``speedtronic`` gave still resolves, with the same object, from the 2.0
facade (``speedtronic.compat.exports``), which the modern names never load."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import speedtronic
from speedtronic.compat.exports import kept_names

ROOT = Path(__file__).resolve().parent.parent

MODERN = {
    "__version__",
    "Event",
    "Callback",
    "CallbackPlan",
    "TrainerView",
    "MetricRecord",
    "TrainResult",
    "Trainer",
    "TrainingStateError",
    "build_runtime",
    "train_from_config",
    "seed_everything",
    "SpeedtronicConfig",
    "ConfigError",
    "load_config",
    "PluginContext",
    "PluginError",
    "register_callback",
    "register_model",
    "build_model",
    "register_dataset",
    "build_dataloader",
}

MODERN_WITHOUT_2_0 = sorted(MODERN - {"__version__"})
"""The front-door names, whose modules are all on the modern path (the Trainer is the
engine's; the runtime builds that one)."""


def _run(code: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


def test_the_front_door_is_the_modern_api() -> None:
    assert set(speedtronic.__all__) == MODERN
    assert len(speedtronic.__all__) == len(MODERN) == 22
    assert not set(kept_names()) & MODERN


def test_every_kept_name_resolves_to_the_object_it_always_was() -> None:
    from speedtronic.compat import exports

    for name in kept_names():
        value = getattr(speedtronic, name)
        if name in exports._KEPT_EXPORTS:
            module = importlib.import_module(exports._KEPT_EXPORTS[name])
            assert value is getattr(module, name), name
        else:
            assert isinstance(value, type), name  # a plugin's class (DiLoCo)


def test_an_unknown_name_is_an_attribute_error() -> None:
    try:
        speedtronic.NoSuchName  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as error:
        assert "has no attribute 'NoSuchName'" in str(error)
    else:
        raise AssertionError("speedtronic.NoSuchName resolved")


def test_the_modern_names_never_load_the_2_0_layer() -> None:
    _run(
        "import sys, speedtronic\n"
        f"for name in {MODERN_WITHOUT_2_0!r}:\n"
        "    getattr(speedtronic, name)\n"
        "import speedtronic.engine.trainer, speedtronic.config\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('speedtronic.compat'))\n"
        "assert loaded == [], loaded\n"
    )


def test_a_2_0_name_loads_the_facade_at_its_first_use() -> None:
    _run(
        "import sys, speedtronic\n"
        "assert 'speedtronic.compat.exports' not in sys.modules\n"
        "from speedtronic import RunConfig, MetricLogger\n"
        "assert 'speedtronic.compat.exports' in sys.modules\n"
        "from speedtronic.config import RunConfig as Same\n"
        "assert RunConfig is Same\n"
    )
