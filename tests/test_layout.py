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
}
"""The composition root and the faces users and tools touch (``user_warnings``: plugin
packages raise their warnings through it, and every layer does, so it sits at the top)."""

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
    assert top == FACES | v2_modules


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
    assert "Contracts: 4 kept, 0 broken." in report


def _repository_copy(tmp_path: Path) -> Path:
    """The packages and pyproject.toml, copied: a place to plant a forbidden import."""
    copy = tmp_path / "repo"
    copy.mkdir()
    shutil.copy(ROOT / "pyproject.toml", copy)
    shutil.copytree(PACKAGE, copy / "speedtronic")
    shutil.copytree(
        ROOT / "callbacks" / "speedtronic_callbacks", copy / "callbacks" / "speedtronic_callbacks"
    )
    return copy


def test_import_linter_catches_an_engine_module_importing_the_cli(tmp_path: Path) -> None:
    copy = _repository_copy(tmp_path)
    notes = copy / "speedtronic" / "engine" / "notes.py"
    notes.write_text(notes.read_text(encoding="utf-8") + "\nimport speedtronic.cli\n")
    code, report = lint_imports(copy)
    assert code == 1
    assert "speedtronic.engine.notes -> speedtronic.cli" in report


def test_import_linter_catches_the_config_layer_importing_the_engine(tmp_path: Path) -> None:
    copy = _repository_copy(tmp_path)
    schema = copy / "speedtronic" / "config" / "schema.py"
    schema.write_text(
        schema.read_text(encoding="utf-8") + "\nimport speedtronic.engine.callback\n"
    )
    code, report = lint_imports(copy)
    assert code == 1
    assert "configuration never imports the engine BROKEN" in report
    assert "speedtronic.config.schema -> speedtronic.engine.callback" in report
