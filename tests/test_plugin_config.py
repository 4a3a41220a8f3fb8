"""Plugins own their configuration: the core names no built-in plugin, and every 2.0 config
still builds the same callbacks, in the same order, with the same options.

``tests/data/legacy_callbacks.json`` was recorded from the code before the plugin
configuration moved into the plugins (``tests/data/legacy_configs.json`` lists the
configs): for each config, every callback's class and its public, plain-valued attributes.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import ClassVar, cast

import pytest
import torch

from speedtronic.config import ConfigError, SpeedtronicConfig
from speedtronic.engine.callback import Callback, JSONSchema, LegacySections, PluginOptions
from speedtronic.plugins import PluginContext, callback_registry, register_callback
from speedtronic.runtime import build_callbacks, callback_specs

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
CONFIGS: dict[str, object] = json.loads((DATA / "legacy_configs.json").read_text())
RECORDED: dict[str, list[list[object]]] = json.loads((DATA / "legacy_callbacks.json").read_text())

CORE_FILES = (
    *(
        REPO / "speedtronic" / f"{name}.py"
        for name in (
            "runtime",
            "composition/run_callbacks",
            "engine/trainer",
            "engine/loop",
            "engine/dispatch",
            "engine/view",
            "engine/filters",
            "engine/forward_path",
            "engine/state",
            "engine/settings",
            "state/training_state",
            "state/run_lock",
        )
    ),
    *sorted((REPO / "speedtronic" / "config").glob("*.py")),
)

DILOCO_KEYS = frozenset(
    {
        "dumb_diloco",
        "hub_dir",
        "repo_id",
        "inner_steps",
        "outer_lr",
        "outer_momentum",
        "sync_timeout_s",
        "node_id",
        "collaborators",
        "reset_inner_optimizer",
        "retry_initial",
        "retry_max",
        "delta_upload_overflow",
    }
)
"""Keys only the DiLoCo plugin may know (its 2.0 section and its options)."""

SECTION_ALIASES = frozenset({"hub", "diloco"})
"""Other spellings of DiLoCo's 2.0 section."""


def builtin_plugin_names() -> set[str]:
    names = {
        entry.name
        for entry in metadata.entry_points(group="speedtronic.callbacks")
        if entry.dist is not None and entry.dist.name == "speedtronic"
    }
    assert {"checkpoint", "console", "jsonl", "diloco", "gradient_checkpointing"} <= names
    return names


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants of a module, its classes and functions, and of the
    string that documents an assignment (prose, where a plugin name may be an English word)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        for statement in body:
            if (
                isinstance(statement, ast.Expr)
                and isinstance(statement.value, ast.Constant)
                and isinstance(statement.value.value, str)
            ):
                found.add(id(statement.value))
    return found


def _names_in_code(path: Path, plugin_names: set[str]) -> Iterator[tuple[int, str]]:
    """``(line, name)`` for every plugin name or DiLoCo key the code of a module uses: as a
    string literal (``"checkpoint"``, ``"checkpoint.every_steps"``), inside a message
    (``"... sync_timeout_s ..."``), as an attribute (``cfg.checkpoint``), a keyword
    argument or a class field. Docstrings are prose and are not searched."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    prose = _docstrings(tree)
    whole = plugin_names | SECTION_ALIASES
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in prose:
                continue
            text = node.value
            if text in whole:
                yield node.lineno, text
            for name in whole:
                if re.search(rf"(^|[\s'\"`]){re.escape(name)}[.:\[]", text):
                    yield node.lineno, name
            for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text):
                if word in DILOCO_KEYS:
                    yield node.lineno, word
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, ast.keyword) and node.arg is not None:
            yield node.lineno, node.arg
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            yield node.lineno, node.target.id


@pytest.mark.parametrize(
    "path", CORE_FILES, ids=lambda path: path.relative_to(REPO / "speedtronic").as_posix()
)
def test_the_core_names_no_builtin_plugin_and_no_diloco_key(path: Path) -> None:
    plugin_names = builtin_plugin_names()
    forbidden = plugin_names | SECTION_ALIASES | DILOCO_KEYS
    found = sorted(
        {(line, name) for line, name in _names_in_code(path, plugin_names) if name in forbidden}
    )
    assert found == [], f"{path.relative_to(REPO)} names plugin things: {found}"
    assert not re.search("diloco", path.read_text(encoding="utf-8"), re.IGNORECASE)


# -- every 2.0 config builds what it built before -------------------------------------------


def _config(name: str) -> SpeedtronicConfig:
    source = CONFIGS[name]
    if isinstance(source, str):  # a file of configs/
        return SpeedtronicConfig.load(REPO / source)
    assert isinstance(source, dict)
    return SpeedtronicConfig.load(source)


def _plain(value: object, root: Path) -> object:
    if isinstance(value, Path):
        return str(value.relative_to(root)) if value.is_relative_to(root) else str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def _described(
    callback: Callback, root: Path, recorded: Iterable[str] = ()
) -> tuple[str, dict[str, object]]:
    """Class name and public attributes, as the recording script saw them; a ``recorded``
    attribute that the class now computes from a component it holds (a read-through
    property) is read through it."""
    values: dict[str, object] = {}
    for key, value in vars(callback).items():
        if key.startswith("_"):
            continue
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            values[key] = dataclasses.asdict(value)
        else:
            values[key] = _plain(value, root)
    for key in recorded:
        if key not in values and isinstance(getattr(type(callback), key, None), property):
            values[key] = _plain(getattr(callback, key), root)
    manager = getattr(callback, "manager", None)
    if manager is not None:
        values["manager"] = {
            "directory": _plain(Path(manager.directory), root),
            "every_steps": manager.every_steps,
            "keep_last": manager.keep_last,
            "enabled": manager.enabled,
        }
    return type(callback).__name__, values


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_every_2_0_config_builds_the_recorded_callbacks(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPEEDTRONIC_NODE_ID", "test-node")
    config = _config(name)
    root = tmp_path.resolve()
    config.run.output_dir = str(root)
    context = PluginContext(config=config, output_dir=root, device=torch.device("cpu"))
    callbacks = build_callbacks(config, context)
    assert [type(callback).__name__ for callback in callbacks] == [
        entry[0] for entry in RECORDED[name]
    ]
    built = [
        _described(callback, root, cast(dict[str, object], entry[1]))
        for callback, entry in zip(callbacks, RECORDED[name], strict=True)
    ]
    assert [cls for cls, _ in built] == [entry[0] for entry in RECORDED[name]]
    for (cls, values), (_, recorded) in zip(built, RECORDED[name], strict=True):
        assert isinstance(recorded, dict)
        for key, expected in recorded.items():  # new attributes may exist; old ones hold
            assert values.get(key) == expected, f"{name}: {cls}.{key}"


def test_the_2_0_sections_are_read_by_the_plugins_that_declare_them() -> None:
    owners = {
        name: callback_registry.get(name).legacy_sections
        for name in ("checkpoint", "console", "jsonl", "gradient_checkpointing", "diloco")
    }
    assert owners == {
        "checkpoint": ("checkpoint",),
        "console": ("logging",),
        "jsonl": ("logging",),
        "gradient_checkpointing": ("gradient_checkpointing", "model"),
        "diloco": ("distributed",),
    }


# -- a third-party plugin uses the same interface -------------------------------------------


PROBE = "test-default-on-probe"


class _DefaultOnProbe(Callback):
    """On by default, after the configured callbacks, turned off through its own key."""

    enabled_by_default: ClassVar[bool] = True
    implied_order: ClassVar[int] = 50
    legacy_sections: ClassVar[tuple[str, ...]] = ("probe_section",)
    legacy_schema: ClassVar[Mapping[str, JSONSchema]] = {
        "probe_section": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "enabled": {"type": "boolean", "default": True, "description": "On."},
                "level": {"type": "integer", "default": 1, "description": "A level."},
            },
        }
    }
    options_schema: ClassVar[JSONSchema] = {
        "type": "object",
        "additionalProperties": False,
        "properties": {"level": {"type": "integer"}},
    }

    def __init__(self, level: int = 1) -> None:
        self.level = level

    @classmethod
    def options_from_legacy(
        cls, sections: LegacySections, options: Mapping[str, object] | None
    ) -> PluginOptions | None:
        section = sections.get("probe_section")
        values = section if isinstance(section, dict) else {}
        if options is None and values.get("enabled") is False:
            return None
        return {"level": values.get("level", 1), **(options or {})}

    @classmethod
    def legacy_errors(cls, sections: LegacySections) -> Iterator[str]:
        section = sections.get("probe_section")
        if isinstance(section, dict) and section.get("level") == 13:
            yield "probe_section.level: 13 is unlucky"


def _names(config: SpeedtronicConfig) -> list[str]:
    return [spec.name for spec in callback_specs(config)]


def test_a_third_party_plugin_is_on_by_default_and_reads_its_own_section() -> None:
    register_callback(PROBE)(_DefaultOnProbe)  # registered here only: it is on by default
    try:
        default = SpeedtronicConfig.load({})
        assert _names(default)[-2:] == ["test-default-on-probe", "checkpoint"]
        configured = SpeedtronicConfig.load({"probe_section": {"level": 4}})
        spec = callback_specs(configured)[-2]
        assert (spec.name, spec.options) == ("test-default-on-probe", {"level": 4})
        off = SpeedtronicConfig.load({"probe_section": {"enabled": False}})
        assert "test-default-on-probe" not in _names(off)
        with pytest.raises(ConfigError, match="probe_section.level: 13 is unlucky"):
            SpeedtronicConfig.load({"probe_section": {"level": 13}})
        with pytest.raises(ConfigError, match="probe_section.typo: unknown key"):
            SpeedtronicConfig.load({"probe_section": {"typo": 1}})
    finally:
        callback_registry.unregister(PROBE)


# -- DiLoCo's rules live in the plugin and are reported with their paths --------------------


def test_diloco_rules_are_reported_by_config_validation_with_their_paths() -> None:
    with pytest.raises(ConfigError) as caught:
        SpeedtronicConfig.load(
            {
                "distributed": {"timeout_s": 600},
                "callbacks": [
                    {"name": "diloco", "inner_steps": 5},
                    {"name": "diloco", "mode": "collective", "sync_timeout_s": 60},
                ],
            }
        )
    assert caught.value.errors == [
        "callbacks[0].hub_dir: set exactly one of hub_dir (shared directory) or repo_id (HF Hub)",
        "callbacks[1].sync_timeout_s: 60 s is shorter than distributed.timeout_s (600 s); an "
        "outer round all-reduces the whole model and waits for the slowest replica, so give "
        "it at least the per-step collective timeout",
    ]


def test_diloco_options_are_checked_by_the_same_schema_in_python() -> None:
    from speedtronic_callbacks.diloco import DiLoCoCallback, DiLoCoOptions

    with pytest.raises(ValueError, match=r"inner_steps: 0 is less than the minimum of 1"):
        DiLoCoOptions(hub_dir="x", inner_steps=0)
    with pytest.raises(ValueError, match="node_index: 3 is not below num_nodes 3"):
        DiLoCoCallback(hub_dir="x", node_index=3, num_nodes=3)


def test_the_diloco_builder_returns_each_mode_as_its_own_class() -> None:
    from speedtronic_callbacks.diloco import DiLoCoCallback, build_diloco
    from speedtronic_callbacks.diloco.collective import CollectiveDiLoCo

    assert type(build_diloco({"mode": "collective"})) is CollectiveDiLoCo
    assert type(build_diloco({"hub_dir": "x"})) is DiLoCoCallback
    with pytest.raises(ValueError, match="build_diloco"):
        DiLoCoCallback.from_options({"mode": "collective"}, _context())


def _context() -> PluginContext:
    config = SpeedtronicConfig()
    return PluginContext(config=config, output_dir=Path("."), device=torch.device("cpu"))


def test_a_2_0_config_resumes_through_the_resume_source(tmp_path: Path) -> None:
    from speedtronic.state.resume import ResumeSource

    config = SpeedtronicConfig.load(
        {"checkpoint": {"resume": True, "load_callback_state": False, "directory": "ck"}}
    )
    context = PluginContext(config=config, output_dir=tmp_path, device=torch.device("cpu"))
    sources = [cb for cb in build_callbacks(config, context) if isinstance(cb, ResumeSource)]
    assert len(sources) == 1
    source = sources[0]
    assert (source.resume_requested, source.load_callback_state) == (True, False)
    assert source.checkpoint_manager.directory == tmp_path / "ck"


@pytest.mark.parametrize("mode", ["hub", "collective"])
def test_diloco_options_are_declared_once_each_dataclass_mirrors_its_schema(mode: str) -> None:
    from speedtronic_callbacks.diloco import options

    schema, dataclass = {
        "hub": (options.HUB_OPTIONS_SCHEMA, options.DiLoCoOptions),
        "collective": (options.COLLECTIVE_OPTIONS_SCHEMA, options.CollectiveDiLoCoOptions),
    }[mode]
    properties = schema["properties"]
    assert isinstance(properties, dict)
    fields = {item.name: item.default for item in dataclasses.fields(dataclass)}
    assert list(fields) == list(properties)
    for name, default in fields.items():
        assert properties[name].get("default", properties[name].get("const")) == default, name


def test_keys_a_plugin_adds_to_a_section_are_declared_once_and_read_typed() -> None:
    """``logging:``'s sink switches are fields of the sink plugins' dataclasses
    (``Sections.declared``): the composed schema is derived from them, and plugins read them
    typed -- ``keys_of`` from the validated sections, ``section.keys_of`` on a built config."""
    from speedtronic.config import declare
    from speedtronic.config.schema import base
    from speedtronic.plugins import keys_of, plugin_spec
    from speedtronic_callbacks.console import ConsoleLoggingKeys
    from speedtronic_callbacks.jsonl import JsonlLoggingKeys

    logging = base()["properties"]["logging"]["properties"]  # type: ignore[index]  # JSON
    for name, declaring in (("console", ConsoleLoggingKeys), ("jsonl", JsonlLoggingKeys)):
        sections = plugin_spec(name).sections
        assert sections.declared == {"logging": declaring}
        assert sections.schema["logging"] == declare.object_schema(declaring)
        for key, schema in declare.object_schema(declaring)["properties"].items():  # type: ignore[attr-defined]  # JSON
            assert logging[key] == schema, key
    from speedtronic_callbacks.time_budget import RunKeys

    run_keys = base()["properties"]["run"]["properties"]  # type: ignore[index]  # JSON
    assert plugin_spec("time_budget").sections.declared == {"run": RunKeys}
    assert run_keys["max_time"] == declare.object_schema(RunKeys)["properties"]["max_time"]  # type: ignore[index]  # JSON
    assert keys_of({"run": {"max_time": "3h"}}, "run", RunKeys) == RunKeys(max_time="3h")
    config = SpeedtronicConfig.load({"logging": {"jsonl": False, "json_file": "m.jsonl"}})
    typed = config.logging.keys_of(JsonlLoggingKeys)
    assert typed == JsonlLoggingKeys(json_file="m.jsonl", jsonl=False)
    assert config.logging.keys_of(ConsoleLoggingKeys) == ConsoleLoggingKeys(console=True)
    data = {"logging": config.logging.to_dict()}
    assert keys_of(data, "logging", JsonlLoggingKeys) == typed
    assert keys_of({}, "logging", ConsoleLoggingKeys) == ConsoleLoggingKeys()  # the defaults
    assert [spec.name for spec in callback_specs(config)].count("jsonl") == 0


def test_2_0_keys_stay_readable_and_count_for_equality() -> None:
    config = SpeedtronicConfig.load(
        {
            "checkpoint": {"every_steps": 3},
            "logging": {"console": False},
            "hub": {"enabled": True, "hub_dir": "/h"},
        }
    )
    assert config.checkpoint.every_steps == 3
    assert (config.logging.console, config.logging.jsonl) == (False, True)
    assert (config.distributed.role, config.distributed.timeout_s) == ("master", 1800.0)
    assert config != SpeedtronicConfig.load({"hub": {"enabled": True, "hub_dir": "/h"}})
    assert config == SpeedtronicConfig.load(config.to_dict())
    config.checkpoint.every_steps = 0
    with pytest.raises(ConfigError, match="checkpoint.every_steps: 0 is less than the minimum"):
        config.validate()


# -- one declaration per option ---------------------------------------------------------------

MAPPED_BY_THE_BUILDER = {
    "checkpoint": ("directory",),  # resolved under the output directory; None = checkpoints
    "jsonl": ("event_key",),  # null: decided from the 2.0 logging.json_file
    "wandb": ("dir", "id"),  # the constructor's directory and run_id
}
"""Options a plugin's builder maps onto its constructor rather than passing them as they are."""


@pytest.mark.parametrize("name", sorted(builtin_plugin_names() - {"diloco"}))
def test_each_builtin_declares_its_options_once_and_takes_them_as_keywords(name: str) -> None:
    from speedtronic.config import declare
    from speedtronic.plugins import plugin_spec

    spec = plugin_spec(name)
    assert spec.options_type is not None, f"{name} declares no options dataclass"
    assert spec.options_schema == declare.object_schema(spec.options_type)
    skip = MAPPED_BY_THE_BUILDER.get(name, ())
    assert declare.signature_mismatches(spec.callback, spec.options_type, skip=skip) == []


def test_diloco_declares_both_modes_and_checks_built_options_once() -> None:
    from speedtronic.config import declare
    from speedtronic.plugins import plugin_spec
    from speedtronic_callbacks.diloco import distributed_section, options

    spec = plugin_spec("diloco")
    assert spec.options_type is options.DiLoCoOptions
    assert (
        options.HUB_OPTIONS_SCHEMA["properties"]
        == (declare.object_schema(options.DiLoCoOptions)["properties"])
    )
    shared = {item.name for item in declare.documented(options.OuterLoopOptions)}
    for declaration in (
        options.CollectiveDiLoCoOptions,
        distributed_section.DistributedSectionKeys,
    ):
        assert shared <= {item.name for item in declare.documented(declaration)}
    built = spec.parse({"hub_dir": "/h", "inner_steps": 7})  # validated data: not checked again
    assert isinstance(built, options.DiLoCoOptions) and built.inner_steps == 7
    collective = spec.parse({"mode": "collective", "fragments": 2})
    assert isinstance(collective, options.CollectiveDiLoCoOptions) and collective.fragments == 2
