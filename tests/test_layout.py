"""The layout of ``speedtronic/`` (DESIGN.md section 2): the folders, what stays at the top, the
2.0 module paths that keep working, and the import arrows of ``[tool.importlinter]`` in
pyproject.toml, checked here on the source (import-linter itself is not a dependency)."""

from __future__ import annotations

import ast
import functools
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "speedtronic"

FACES = {"__init__", "__main__", "runtime", "cli", "plugins", "user_imports", "testing", "plotting"}
"""The composition root and the faces users and tools touch."""

V2_PATHS: dict[str, str] = {
    "config": (
        "ConfigError RunConfig ModelConfig DataConfig OptimizerConfig SchedulerConfig "
        "PrecisionConfig LoggingConfig DistributedConfig ShapeValidationConfig "
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


def _outside_type_checking(tree: ast.Module) -> Iterator[ast.stmt]:
    """Every statement except those under ``if TYPE_CHECKING:``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test) in (
                "TYPE_CHECKING",
                "typing.TYPE_CHECKING",
            ):
                for statement in child.orelse:
                    yield statement
                    stack.append(statement)
                continue
            if isinstance(child, ast.stmt):  # imports are statements: skip expressions
                yield child
                stack.append(child)
            elif isinstance(child, ast.excepthandler):
                stack.append(child)


def imports_of(source: str, known: set[str]) -> set[str]:
    """The modules ``source`` imports at run time (anywhere in the file, as import-linter counts
    them; ``from a import b`` imports ``a.b`` when that is a module)."""
    found: set[str] = set()
    for node in _outside_type_checking(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            found.add(node.module)
            found.update(
                f"{node.module}.{alias.name}"
                for alias in node.names
                if f"{node.module}.{alias.name}" in known
            )
    return found


@functools.cache
def import_graph() -> dict[str, set[str]]:
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "callbacks" / "speedtronic_callbacks").rglob("*.py")]
    known = {module_name(path) for path in files}
    return {
        module_name(path): imports_of(path.read_text(encoding="utf-8"), known) for path in files
    }


def within(name: str, packages: list[str]) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def forbidden_chains(
    graph: dict[str, set[str]], sources: list[str], forbidden: list[str]
) -> list[list[str]]:
    chains = []
    for start in sorted(name for name in graph if within(name, sources)):
        seen = {start: [start]}
        queue = [start]
        while queue:
            here = queue.pop(0)
            for there in sorted(graph.get(here, set())):
                if within(there, forbidden):
                    chains.append([*seen[here], there])
                elif there in graph and there not in seen:
                    seen[there] = [*seen[here], there]
                    queue.append(there)
    return chains


CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"][
    "importlinter"
]["contracts"]


@pytest.mark.parametrize("contract", CONTRACTS, ids=lambda contract: contract["name"])
def test_the_import_contracts_hold(contract: dict[str, object]) -> None:
    assert contract["type"] == "forbidden"
    sources, forbidden = contract["source_modules"], contract["forbidden_modules"]
    assert isinstance(sources, list) and isinstance(forbidden, list)
    chains = forbidden_chains(import_graph(), sources, forbidden)
    assert chains == [], "\n".join(" -> ".join(chain) for chain in chains[:5])


def test_the_contract_check_finds_an_indirect_import() -> None:
    graph = {"a.x": {"a.y"}, "a.y": {"b.z"}, "b.z": set(), "a.w": {"c"}}
    assert forbidden_chains(graph, ["a"], ["b"]) == [["a.x", "a.y", "b.z"], ["a.y", "b.z"]]
    source = (
        "import os\nif TYPE_CHECKING:\n    import b.z\nelse:\n    import c\n"
        "def f():\n    from a import y, q\n"
    )
    assert imports_of(source, {"a.y"}) == {"os", "c", "a", "a.y"}
