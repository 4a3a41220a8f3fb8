"""The JSON Schema documents: packaged core, composition with plugins, published copies."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path
from typing import ClassVar

import pytest
from cli_runner import run_cli
from jsonschema import Draft202012Validator

from speedtronic.config import (
    ConfigError,
    SpeedtronicConfig,
    builtin_callback_names,
    composed_schema,
    core_schema,
    load_config,
    write_schemas,
)
from speedtronic.config.schema import (
    CORE_SCHEMA_ID,
    callback_schema_id,
    packaged_core_schema,
    plugin_root_keys,
    plugin_section_keys,
)
from speedtronic.config.sections import _SECTION_TYPES
from speedtronic.engine.callback import Callback, JSONSchema
from speedtronic.plugins import register_callback

REPO = Path(__file__).resolve().parents[1]
PUBLISHED = REPO / "schemas"
REGENERATE = "run `speedtronic schema --write schemas` and commit the result"

SCHEMA_PROBE = "test-schema-probe"


@register_callback(SCHEMA_PROBE)
class _SchemaProbe(Callback):
    options_schema: ClassVar[JSONSchema] = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "additionalProperties": False,
        "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1}},
    }


def _without_callback_composition(schema: dict[str, object]) -> dict[str, object]:
    stripped = json.loads(json.dumps(schema))
    stripped["properties"]["callbacks"]["items"].pop("allOf", None)
    return stripped  # type: ignore[no-any-return]  # json.loads of a dict is a dict


def test_packaged_core_schema_is_a_valid_documented_2020_12_schema() -> None:
    schema = core_schema()
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] == CORE_SCHEMA_ID
    packaged = resources.files("speedtronic").joinpath("schemas", "run.schema.json")
    # The packaged file holds the core's keys; core_schema() adds what plugins declare.
    assert json.loads(packaged.read_text(encoding="utf-8")) == packaged_core_schema()
    properties = schema["properties"]
    assert isinstance(properties, dict)
    for section in _SECTION_TYPES:
        assert properties[section]["title"] == section
        for key, spec in properties[section]["properties"].items():
            assert spec.get("description"), f"{section}.{key} has no description"


def test_core_schema_matches_the_dataclasses() -> None:
    """Every dataclass field is in the schema with the same default, and nothing else."""
    properties = core_schema()["properties"]
    assert isinstance(properties, dict)
    for section, section_type in _SECTION_TYPES.items():
        # Keys plugins add to a section are kept beside its fields (``extensions``).
        added = plugin_section_keys(section)
        schema_keys = {
            key: spec for key, spec in properties[section]["properties"].items() if key not in added
        }
        fields = {item.name: item for item in dataclasses.fields(section_type)}
        assert list(schema_keys) == list(fields), section
        extensions = section_type().extensions
        assert list(extensions) == list(added), section
        for key in added:
            assert extensions[key] == properties[section]["properties"][key]["default"]
        for name, item in fields.items():
            if item.default_factory is not dataclasses.MISSING:
                default: object = item.default_factory()
            else:
                default = item.default
            if isinstance(default, tuple):
                default = list(default)
            assert schema_keys[name]["default"] == default, f"{section}.{name}"
    root_fields = [item.name for item in dataclasses.fields(SpeedtronicConfig)]
    plugin_keys = plugin_root_keys()
    assert [k for k in properties if k != "$schema" and k not in plugin_keys] == root_fields
    assert list(SpeedtronicConfig().plugin_keys) == list(plugin_keys)


def test_default_config_is_valid_against_the_published_schema() -> None:
    published = json.loads((PUBLISHED / "run.schema.json").read_text(encoding="utf-8"))
    validator = Draft202012Validator(published)
    assert list(validator.iter_errors(SpeedtronicConfig().to_dict())) == []


def test_published_schemas_are_current(tmp_path: Path) -> None:
    write_schemas(tmp_path, builtin_callback_names())
    expected = {p.relative_to(tmp_path): p.read_text() for p in tmp_path.rglob("*.json")}
    actual = {p.relative_to(PUBLISHED): p.read_text() for p in PUBLISHED.rglob("*.json")}
    assert sorted(actual) == sorted(expected), f"schemas/ has other files: {REGENERATE}"
    for relative, text in expected.items():
        assert actual[relative] == text, f"schemas/{relative} is stale: {REGENERATE}"


def test_published_run_schema_embeds_the_packaged_core() -> None:
    published = json.loads((PUBLISHED / "run.schema.json").read_text(encoding="utf-8"))
    assert _without_callback_composition(published) == core_schema()


def test_composed_schema_checks_each_plugins_options() -> None:
    schema = composed_schema([SCHEMA_PROBE])
    Draft202012Validator.check_schema(schema)
    assert _without_callback_composition(schema) == core_schema()
    assert composed_schema([]) == core_schema()
    validator = Draft202012Validator(schema)
    good = {"callbacks": [{"name": SCHEMA_PROBE, "ratio": 0.5}]}
    assert list(validator.iter_errors(good)) == []
    bad = {"callbacks": [{"name": SCHEMA_PROBE, "ratio": 2, "other": 1}]}
    found = sorted((list(e.absolute_path), e.validator) for e in validator.iter_errors(bad))
    assert found == [
        (["callbacks", 0], "additionalProperties"),
        (["callbacks", 0, "ratio"], "maximum"),
    ]
    assert SCHEMA_PROBE in json.dumps(composed_schema())  # default: every known plugin


def test_write_schemas_writes_plugin_documents_and_removes_stale_ones(tmp_path: Path) -> None:
    stale = tmp_path / "callbacks" / "gone.schema.json"
    stale.parent.mkdir()
    stale.write_text("{}")
    written = write_schemas(tmp_path, [SCHEMA_PROBE])
    plugin_file = tmp_path / "callbacks" / f"{SCHEMA_PROBE}.schema.json"
    assert written == [tmp_path / "run.schema.json", plugin_file]
    assert not stale.exists()
    document = json.loads(plugin_file.read_text(encoding="utf-8"))
    Draft202012Validator.check_schema(document)
    assert document["$id"] == callback_schema_id(SCHEMA_PROBE)
    assert document["properties"] == {"ratio": {"type": "number", "minimum": 0, "maximum": 1}}
    run_schema = json.loads((tmp_path / "run.schema.json").read_text(encoding="utf-8"))
    assert run_schema == composed_schema([SCHEMA_PROBE])


def test_schema_write_replaces_files_atomically_never_writing_through_a_link(
    tmp_path: Path,
) -> None:
    # write_text truncated and rewrote each file in place: through a link at its name (into
    # the file it leads to) and, cut short, leaving half a schema for editors to read.
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("precious\n")
    out = tmp_path / "schemas"
    out.mkdir()
    (out / "run.schema.json").symlink_to(elsewhere)
    result = run_cli("schema", "--write", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"wrote {out / 'run.schema.json'}" in result.stdout
    assert elsewhere.read_text() == "precious\n"
    assert not (out / "run.schema.json").is_symlink()
    assert json.loads((out / "run.schema.json").read_text()) == composed_schema(
        builtin_callback_names()
    )
    assert not [p.name for p in out.rglob(".*")]  # no temporary file left behind


def test_broken_plugin_schema_is_reported_not_crashed_on() -> None:
    name = "test-schema-broken"

    @register_callback(name)
    class _Broken(Callback):
        options_schema: ClassVar[JSONSchema] = {"type": "objekt"}

    with pytest.raises(ConfigError) as caught:
        load_config({"callbacks": [{"name": name}]})
    assert caught.value.errors[0].startswith(
        f"callbacks[0].name: callback {name!r} has an invalid options schema: "
    )


def test_shipped_example_configs_validate() -> None:
    for path in sorted((REPO / "configs").glob("*.yaml")):
        load_config(path)
