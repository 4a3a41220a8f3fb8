"""The layout of ``speedtronic/`` (DESIGN.md section 2): the folders, what stays at the top, the
2.0 module paths that keep working, and the import arrows of ``[tool.importlinter]`` in
pyproject.toml, checked by import-linter."""

from __future__ import annotations

import ast
import importlib
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "speedtronic"

FACES = {
    "__init__",
    "__main__",
    "runtime",
    "cli",
    "plugins",
    "user_imports",
    "user_warnings",
    "testing",
    "plotting",
    "lm_harness",
}
"""The composition root and the faces users and tools touch (``user_warnings``: plugin
packages raise their warnings through it, and every layer does)."""

LEAVES = {"_version", "errors"}
"""Leaf modules every layer may import, which import nothing of the package: the version
(checkpoints record it) and ``ConfigError`` (models raise it below the config layer)."""

V2_PATHS: dict[str, str] = {
    "config": (
        "ConfigError RunConfig ModelConfig DataConfig OptimizerConfig SchedulerConfig "
        "PrecisionConfig CheckpointConfig LoggingConfig DistributedConfig ShapeValidationConfig "
        "SpeedtronicConfig Config load_config load_yaml_config"
    ),
    "runtime": (
        "seed_everything build_optimizer build_scheduler build_logger build_runtime "
        "train_from_config run train"
    ),
    "trainer": "SyncCoordinator TrainResult Trainer TrainingEngine SpeedtronicTrainer",
    "data": (
        "CharTokenizer SyntheticTokenDataset TextFileTokenDataset collate_causal collate_batch "
        "infinite_batches build_dataloader"
    ),
    "model": (
        "GPTConfig RMSNorm apply_rope RotaryEmbedding CausalSelfAttention SwiGLU "
        "TransformerBlock ReferenceTransformer GPT Transformer ReferenceModel GPTModel "
        "TransformerConfig"
    ),
    "precision": (
        "PrecisionPlan resolve_device resolve_precision autocast_context make_grad_scaler "
        "supports_fused_adamw parameter_count"
    ),
    "checkpoint": (
        "CheckpointError atomic_torch_save atomic_json_dump CheckpointManager "
        "capture_rng_state restore_rng_state"
    ),
    "profiling": "TrainingHook memory_usage_bytes MetricLogger CallbackList Metric Hook",
    "hooks": "on_event",
    "integrations": "WandbHook TensorboardHook",
    "module_utils": "set_gradient_checkpointing",
    "cli": "main",
    "distributed": "setup_distributed DistributedContext RankMetricReducer",
    "optimizers": (
        "CautiousOptimizer HybridOptimizer Muon ParameterRouting newton_schulz "
        "post_polar_normalize route_parameters"
    ),
    "shapes": (
        "ShapeProfile ShapeReport ShapeWarning resolve_shape_profile validate_startup_shapes"
    ),
    "scheduling": "StageInfo StageStreamScheduler",
}
"""2.0's module paths and their names (reference/seed-core.md section 1). ``speedtronic.registry``
is the registry instance now (``tests/test_static_types.py``); the DiLoCo names of
``speedtronic.distributed`` are checked in ``tests/test_compat_diloco.py``."""

REEXPORTS = {
    "trainer": "speedtronic.engine.trainer",
    "model": "speedtronic.models.transformer",
    "precision": "speedtronic.systems.precision",
    "checkpoint": "speedtronic.state.checkpoint",
    "distributed": "speedtronic.systems.distributed",
    "shapes": "speedtronic.systems.shapes",
}
"""The 2.0 paths whose code moved, and where it lives."""


def test_the_top_level_holds_only_the_faces_and_the_2_0_paths() -> None:
    top = {path.stem for path in PACKAGE.glob("*.py")}
    v2_modules = {name for name in V2_PATHS if (PACKAGE / f"{name}.py").is_file()}
    assert top == FACES | LEAVES | v2_modules


@pytest.mark.parametrize("path", sorted(V2_PATHS))
def test_a_2_0_module_path_gives_its_2_0_names(path: str) -> None:
    module = importlib.import_module(f"speedtronic.{path}")
    missing = [name for name in V2_PATHS[path].split() if not hasattr(module, name)]
    assert missing == []


@pytest.mark.parametrize("path", sorted(REEXPORTS))
def test_a_moved_2_0_path_re_exports_the_implementation(path: str) -> None:
    shim = importlib.import_module(f"speedtronic.{path}")
    implementation = importlib.import_module(REEXPORTS[path])
    declared = getattr(implementation, "__all__", None)
    if declared is not None:
        assert set(declared) <= set(shim.__all__)
    for name in shim.__all__:
        if hasattr(implementation, name):  # else a 2.0 name the implementation does not use
            assert getattr(shim, name) is getattr(implementation, name), name
    source = Path(shim.__file__ or "").read_text(encoding="utf-8")
    classes = [node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)]
    assert classes == [], f"speedtronic.{path} re-exports; its code lives in {REEXPORTS[path]}"


# -- the import arrows ------------------------------------------------------------------------


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT / ("callbacks" if "callbacks" in path.parts else "")).parts
    name = ".".join(parts).removesuffix(".py")
    return name.removesuffix(".__init__")


def lint_imports(root: Path) -> tuple[int, str]:
    """Run import-linter (``lint-imports``) on the contracts in ``root/pyproject.toml``, with
    ``root`` first on the path: its exit code and report."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "callbacks")])}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from importlinter.cli import lint_imports_command as c; c()",
            "--no-cache",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


def test_the_import_contracts_hold() -> None:
    code, report = lint_imports(ROOT)
    assert code == 0, report
    assert "Contracts: 10 kept, 0 broken." in report


def copy_with_imports(tmp_path: Path, imports: Mapping[str, str]) -> Path:
    """A copy of the packages and ``pyproject.toml`` where each module of ``imports``
    (a path under ``speedtronic/``) ends with the import statement given for it: a place to
    plant a forbidden import."""
    copy = tmp_path / "repo"
    copy.mkdir()
    shutil.copy(ROOT / "pyproject.toml", copy)
    shutil.copytree(PACKAGE, copy / "speedtronic")
    shutil.copytree(
        ROOT / "callbacks" / "speedtronic_callbacks", copy / "callbacks" / "speedtronic_callbacks"
    )
    for module, statement in imports.items():
        path = copy / "speedtronic" / module
        path.write_text(path.read_text(encoding="utf-8") + f"\n{statement}\n")
    return copy


def test_import_linter_catches_an_engine_module_importing_the_cli(tmp_path: Path) -> None:
    copy = copy_with_imports(tmp_path, {"engine/notes.py": "import speedtronic.cli"})
    code, report = lint_imports(copy)
    assert code == 1
    assert "speedtronic.engine.notes -> speedtronic.cli" in report


def test_import_linter_catches_the_engine_importing_the_config_or_the_2_0_layer(
    tmp_path: Path,
) -> None:
    """The engine is built from resolved values (issue 24): a module of it that imports
    ``speedtronic.config`` or anything of ``speedtronic.compat`` breaks the contract."""
    imports = {
        "engine/notes.py": "import speedtronic.config.sections",
        "engine/metrics.py": "from speedtronic.compat import hooks",
    }
    code, report = lint_imports(copy_with_imports(tmp_path, imports))
    assert code == 1
    assert "speedtronic.engine is not allowed to import speedtronic.config:" in report
    assert "speedtronic.engine is not allowed to import speedtronic.compat:" in report
    assert "speedtronic.engine.notes -> speedtronic.config.sections" in report
    assert "speedtronic.engine.metrics -> speedtronic.compat.hooks" in report


def test_import_linter_catches_the_config_layer_importing_the_engine(tmp_path: Path) -> None:
    copy = copy_with_imports(tmp_path, {"config/schema.py": "import speedtronic.engine.callback"})
    code, report = lint_imports(copy)
    assert code == 1
    assert "configuration never imports the engine BROKEN" in report
    assert "speedtronic.config.schema -> speedtronic.engine.callback" in report


@pytest.mark.parametrize(
    ("module", "statement", "arrow"),
    [
        # a building block reaching up to the engine (issue 33: state, systems, models, data)
        ("state/rng.py", "import speedtronic.engine.callback", "speedtronic.state.rng -> "),
        ("systems/precision.py", "import speedtronic.engine.events", "speedtronic.systems."),
        ("data/stream.py", "import speedtronic.engine.metrics", "speedtronic.data.stream -> "),
        ("models/summary.py", "import speedtronic.engine.view", "speedtronic.models.summary -> "),
        # the config layer reaching up to the 2.0 layer, the engine to the runtime
        ("config/declare.py", "import speedtronic.compat.hooks", "speedtronic.config.declare -> "),
        ("state/layout.py", "import speedtronic.models.loss", "speedtronic.state.layout -> "),
    ],
)
def test_import_linter_catches_an_import_up_the_layers(
    tmp_path: Path, module: str, statement: str, arrow: str
) -> None:
    """``layers point down``: a module importing from a layer above its own fails the check."""
    code, report = lint_imports(copy_with_imports(tmp_path, {module: statement}))
    assert code == 1
    assert "layers point down BROKEN" in report
    assert arrow in report


@pytest.mark.parametrize(
    ("module", "statement", "contract", "arrow"),
    [
        # What needs the version reads ``speedtronic._version``, never the root (which would
        # make a checkpoint writer import every public name's module).
        (
            "state/rng.py",
            "from speedtronic import __version__",
            "nothing inside the package imports its root",
            "speedtronic.state.rng -> speedtronic (",
        ),
        (
            "models/summary.py",
            "import speedtronic.compat.hooks",
            "the modern path never imports the 2.0 layer",
            "speedtronic.models.summary -> speedtronic.compat.hooks",
        ),
        # The runtime builds the engine's Trainer; 2.0's members are the root's loader's.
        (
            "runtime.py",
            "import speedtronic.compat.trainer",
            "the modern path never imports the 2.0 layer",
            "speedtronic.runtime -> speedtronic.compat.trainer",
        ),
        (
            "composition/run_callbacks.py",
            "from speedtronic.compat import metric_logger",
            "the modern path never imports the 2.0 layer",
            "speedtronic.composition.run_callbacks -> speedtronic.compat.metric_logger",
        ),
    ],
)
def test_import_linter_catches_the_root_or_the_2_0_layer_imported_from_inside(
    tmp_path: Path, module: str, statement: str, contract: str, arrow: str
) -> None:
    code, report = lint_imports(copy_with_imports(tmp_path, {module: statement}))
    assert code == 1
    assert f"{contract} BROKEN" in report
    assert arrow in report


def test_import_linter_catches_two_packages_importing_each_other(tmp_path: Path) -> None:
    """``no import cycle between packages``: ``models`` reads ``data`` (the tokenizer extra),
    so ``data`` importing ``models`` -- allowed by the layers, which join the building blocks
    as siblings -- closes a cycle and fails."""
    copy = copy_with_imports(tmp_path, {"data/stream.py": "import speedtronic.models.summary"})
    code, report = lint_imports(copy)
    assert code == 1
    assert "no import cycle between packages BROKEN" in report
    assert "- .data -> .models (1 import)" in report


def test_import_linter_catches_a_building_block_importing_the_runtime(tmp_path: Path) -> None:
    """The runtime reads evaluation tasks and texts, so an evaluation module that loads a run
    through the runtime (as the lm-evaluation-harness adapter does, from its own module
    ``lm_harness``) ties the two packages in a cycle: both the layers and the acyclic
    contract refuse it, with no exception for it."""
    copy = copy_with_imports(tmp_path, {"evaluation/likelihood.py": "import speedtronic.runtime"})
    code, report = lint_imports(copy)
    assert code == 1
    assert "no import cycle between packages BROKEN" in report
    assert "- .evaluation -> .runtime (1 import)" in report
    assert "layers point down BROKEN" in report


def test_import_linter_catches_the_config_machinery_importing_the_declarations(
    tmp_path: Path,
) -> None:
    """``the config modules import one way``: the schema reads the core's declarations
    through ``config/core.py``; importing ``sections`` back closes a cycle and fails."""
    copy = copy_with_imports(tmp_path, {"config/schema.py": "import speedtronic.config.sections"})
    code, report = lint_imports(copy)
    assert code == 1
    assert "the config modules import one way BROKEN" in report
    assert "- .schema -> .sections (1 import)" in report
