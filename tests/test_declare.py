"""One declaration per option (``speedtronic.config.declare``): the schema, the defaults, the
typed object and the docs row all come from one annotated dataclass field."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Annotated, Literal

import pytest
from jsonschema import Draft202012Validator

from speedtronic.config import declare
from speedtronic.config.declare import Opt


@dataclass(frozen=True)
class Window:
    """A step window."""

    start: Annotated[int, Opt("First step.", minimum=0)]
    length: Annotated[int, Opt("Steps in it.", minimum=1)] = 3


@dataclass(frozen=True)
class Probe:
    rate: Annotated[float, Opt("How often, per [step](events.md).", exclusive_minimum=0)] = 1.0
    mode: Annotated[Literal["min", "max"], Opt("Which is better.")] = "min"
    label: Annotated[str | None, Opt("A label.", min_length=1)] = None
    ranks: Annotated[list[int], Opt("Ranks.", items={"minimum": 0})] = field(
        default_factory=lambda: [0]
    )
    betas: Annotated[tuple[float, float], Opt("Two numbers.")] = (0.9, 0.95)
    windows: Annotated[list[Window], Opt("Windows.")] = field(default_factory=list)

    def __post_init__(self) -> None:
        raise AssertionError("built from validated data: __post_init__ must not run")


def test_the_schema_is_derived_from_the_fields() -> None:
    schema = declare.object_schema(Probe)
    Draft202012Validator.check_schema(schema)
    properties = schema["properties"]
    assert isinstance(properties, dict)
    assert schema["additionalProperties"] is False
    assert properties["rate"] == {
        "type": "number",
        "default": 1.0,
        "description": "How often, per step.",  # a markdown link becomes its text
        "exclusiveMinimum": 0,
    }
    assert properties["mode"] == {
        "enum": ["min", "max"],
        "default": "min",
        "description": "Which is better.",
    }
    assert properties["label"]["type"] == ["string", "null"]
    assert properties["label"]["minLength"] == 1
    assert properties["ranks"]["items"] == {"type": "integer", "minimum": 0}
    assert properties["betas"]["minItems"] == properties["betas"]["maxItems"] == 2
    window = properties["windows"]["items"]
    assert window["required"] == ["start"] and window["description"] == "A step window."
    validator = Draft202012Validator(schema)
    assert list(validator.iter_errors({"rate": 2, "windows": [{"start": 1}]})) == []
    bad = {"rate": 0, "mode": "avg", "windows": [{"length": 0}], "other": 1}
    assert len(list(validator.iter_errors(bad))) == 5  # rate, mode, start, length, other


def test_build_takes_validated_data_as_it_is_and_fills_the_defaults() -> None:
    probe = declare.build(Probe, {"rate": 2, "betas": [0.5, 0.6], "windows": [{"start": 4}]})
    assert probe.rate == 2.0 and isinstance(probe.rate, float)
    assert probe.betas == (0.5, 0.6)
    assert probe.windows == [Window(start=4, length=3)]
    assert probe.mode == "min" and probe.ranks == [0] and probe.label is None
    assert declare.defaults_of(Probe) == {
        "rate": 1.0,
        "mode": "min",
        "label": None,
        "ranks": [0],
        "betas": [0.9, 0.95],
        "windows": [],
    }


def test_the_docs_row_comes_from_the_same_field() -> None:
    rows = {row[0]: row for row in declare.doc_rows(Probe)}
    assert rows["`rate`"] == ("`rate`", "number > 0", "`1.0`", "How often, per [step](events.md).")
    assert rows["`mode`"][1] == "`min` | `max`"
    assert rows["`label`"][1:3] == ("string or null", "`null`")
    assert rows["`ranks`"][1] == "list of ints"
    table = declare.markdown_table(Window)
    assert table.splitlines()[2] == "| `start` | int ≥ 0 | required | First step. |"


def test_a_constructor_that_repeats_the_options_is_checked() -> None:
    def good(start: int, length: int = 3) -> None: ...

    def stale(start: int, length: int = 5) -> None: ...

    def short(start: int) -> None: ...

    assert declare.signature_mismatches(good, Window) == []
    assert declare.signature_mismatches(stale, Window) == ["length: default 5, declared 3"]
    assert declare.signature_mismatches(short, Window) == ["length: no parameter"]


def test_an_undeclarable_type_is_refused() -> None:
    @dataclass
    class Odd:
        value: Annotated[complex, Opt("No JSON type.")] = 1j

    with pytest.raises(TypeError, match="no JSON Schema"):
        declare.object_schema(Odd)


def test_the_built_in_models_declare_their_options_the_same_way() -> None:
    """``model.options`` of ``hf_causal_lm`` and of the reference transformer come from
    options dataclasses (declared below the config package, in ``speedtronic.util.options``):
    the registry's schema is the derived one, and each factory's keywords repeat the
    declared defaults."""
    from speedtronic.models import hf
    from speedtronic.models.document_attention import KERNELS, ReferenceTransformerOptions
    from speedtronic.models.registry import registry
    from speedtronic.models.transformer import ReferenceTransformer

    cases = (
        ("hf_causal_lm", hf.HFCausalLMOptions, hf.build_hf_causal_lm),
        ("reference_transformer", ReferenceTransformerOptions, ReferenceTransformer),
        ("gpt", ReferenceTransformerOptions, ReferenceTransformer),
    )
    for name, options, factory in cases:
        schema = registry.options_schema(name)
        assert schema is not None
        derived = declare.object_schema(options)
        assert schema["properties"] == derived["properties"], name
        assert schema["additionalProperties"] is False
        Draft202012Validator.check_schema(dict(schema))
        assert declare.signature_mismatches(factory, options) == [], name
    dtype = declare.field_of(hf.HFCausalLMOptions, "dtype").hint
    assert sorted(typing.get_args(dtype)) == sorted(hf.DTYPES)
    assert KERNELS == ("auto", "sdpa", "flex")
    hf_schema = hf.HF_OPTIONS_SCHEMA
    validator = Draft202012Validator(dict(hf_schema))
    assert not list(validator.iter_errors({"config": {"model_type": "llama"}, "dtype": "bfloat16"}))
    assert list(validator.iter_errors({"config": {}}))  # model_type is required
    assert list(validator.iter_errors({"extra_config_keys": ["a", "a"]}))  # unique
    assert list(validator.iter_errors({"pretrained": ""}))
    assert list(validator.iter_errors({"dtype": "float16"}))
