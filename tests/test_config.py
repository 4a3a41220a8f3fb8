"""Configuration: sources, shorthands, overrides, validation errors, typing, round trips."""

from __future__ import annotations

import json
import textwrap
import uuid
from pathlib import Path
from typing import ClassVar

import pytest
from torch.utils.data import TensorDataset

from speedtronic.config import (
    CallbackSpec,
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    RoutingRule,
    RunConfig,
    SpeedtronicConfig,
    apply_overrides,
    load_config,
    load_yaml_config,
    parse_override,
)
from speedtronic.config.sections import JSONValue
from speedtronic.data import dataset_registry
from speedtronic.engine.callback import Callback, JSONSchema
from speedtronic.plugins import closest_name, register_callback

PROBE = "test-config-probe"


@register_callback(PROBE)
class _Probe(Callback):
    """A callback plugin whose options schema the tests exercise."""

    plugin_name: ClassVar[str | None] = PROBE
    options_schema: ClassVar[JSONSchema] = {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "every_steps": {"$ref": "#/$defs/positive"},
            "label": {"type": "string"},
            "token": {"type": ["string", "null"]},
        },
        "$defs": {"positive": {"type": "integer", "minimum": 1}},
    }


def section(values: dict[str, JSONValue], name: str) -> dict[str, JSONValue]:
    found = values[name]
    assert isinstance(found, dict)
    return found


def errors_of(source: object, overrides: tuple[str, ...] = ()) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(source, overrides)  # type: ignore[arg-type]  # deliberately ill-typed input
    return caught.value.errors


# -- the original acceptance tests, adapted ------------------------------------------------


def test_config_yaml_aliases_and_accumulation(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        textwrap.dedent(
            """
            name: unit
            max_steps: 7
            model: {vocab_size: 128, max_seq_len: 16, d_model: 32, n_head: 4}
            data: {micro_batch_size: 2, target_batch_size: 6}
            compile: {enabled: true}
            """
        )
    )
    config = load_config(path)
    assert config.run.name == "unit"
    assert config.run.max_steps == 7
    assert config.accumulation_steps == 3
    assert config.compile is True
    assert config.model.n_kv_head == 4
    assert load_yaml_config(path) == config


def test_config_round_trip(tmp_path: Path) -> None:
    config = SpeedtronicConfig.from_dict({"max_steps": 2, "precision": {"mode": "fp32"}})
    for name in ("config.yaml", "config.json"):
        saved = config.save(tmp_path / name)
        assert load_config(saved).to_dict() == config.to_dict()


def test_rich_config_round_trip(tmp_path: Path) -> None:
    config = load_config(
        {
            "optimizer": {
                "name": "muon",
                "muon_plus": True,
                "routing": [{"to": "adamw", "name": "head.*"}, {"to": "muon", "ndim": 2}],
            },
            "scheduler": {"max_steps": 1000},
            "shape_validation": {"alignment": 8},
            "data": {"dataset_options": {"path": "x", "splits": [1, 2]}},
            "callbacks": [{"name": PROBE, "every_steps": 3, "label": "a"}],
            "ooo_backprop": True,
            "ooo_streams": 2,
        }
    )
    saved = config.save(tmp_path / "nested" / "run.yaml")
    reloaded = load_config(saved)
    assert reloaded.to_dict() == config.to_dict()
    assert reloaded == config
    assert [p.name for p in saved.parent.iterdir()] == ["run.yaml"]  # no temp files left


def test_unknown_keys_and_invalid_batch() -> None:
    assert errors_of({"not_a_key": 1}) == ["not_a_key: unknown key"]
    assert errors_of({"data": {"micro_batch_size": 3, "target_batch_size": 4}}) == [
        "data.target_batch_size: 4 is not divisible by data.micro_batch_size (3)"
    ]
    assert errors_of({"data": {"micro_batch_size": 4, "target_batch_size": 2}}) == [
        "data.target_batch_size: 2 is less than data.micro_batch_size (4)"
    ]


def test_distributed_role_inference() -> None:
    config = load_config({"distributed": {"enabled": True, "repo_id": "org/run"}})
    assert config.distributed.role == "master"
    shared = load_config({"hub": {"enabled": True, "hub_dir": "/shared/hub"}})
    assert shared.distributed.role == "master"
    worker = load_config({"diloco": {"enabled": True, "repo_id": "o/r", "role": "Worker"}})
    assert worker.distributed.role == "worker"


def test_secret_can_be_redacted_for_serialization(tmp_path: Path) -> None:
    config = load_config(
        {
            "distributed": {"repo_id": "org/run", "token": "secret"},
            "callbacks": [{"name": PROBE, "token": "hunter2"}],
        }
    )
    plain = config.to_dict()
    assert section(plain, "distributed")["token"] == "secret"
    redacted = config.to_dict(redact_secrets=True)
    assert section(redacted, "distributed")["token"] == "<redacted>"
    assert redacted["callbacks"] == [{"name": PROBE, "token": "<redacted>"}]
    for name in ("run.yaml", "run.json"):
        text = config.save(tmp_path / name).read_text()
        assert "secret" not in text and "hunter2" not in text
    assert "secret" not in repr(config) and "hunter2" not in repr(config)
    # A saved copy never brings back a fake token: "<redacted>" loads as no token.
    assert load_config(tmp_path / "run.yaml").distributed.token is None


def test_v2_config_accepts_scalar_optimizer_and_root_flags() -> None:
    config = load_config(
        {
            "optimizer": "muon",
            "muon_plus": True,
            "cautious": True,
            "ooo_backprop": True,
            "ooo_streams": 2,
        }
    )
    assert config.optimizer.name == "muon"
    assert config.optimizer.muon_plus and config.optimizer.cautious
    assert config.ooo_backprop is True and config.ooo_streams == 2


def test_muon_plus_requires_muon() -> None:
    assert errors_of({"optimizer": {"name": "adamw", "muon_plus": True}}) == [
        "optimizer.muon_plus: requires optimizer.name 'muon' (got 'adamw')"
    ]
    with pytest.raises(ConfigError):
        OptimizerConfig(muon_plus=True)


def test_v2_config_rejects_invalid_systems_values() -> None:
    assert errors_of({"ooo_streams": 0}) == ["ooo_streams: 0 is less than the minimum of 1"]
    assert errors_of({"ooo_streams": 9}) == ["ooo_streams: 9 is greater than the maximum of 8"]
    assert errors_of({"shape_validation": {"alignment": 0}}) == [
        "shape_validation.alignment: 0 is less than the minimum of 1"
    ]
    assert errors_of({"shape_validation": {"alignment": "wide"}}) == [
        "shape_validation.alignment: 'wide' is not one of ['auto', 'none']"
    ]
    assert errors_of({"shape_validation": {"alignment": True}}) == [
        "shape_validation.alignment: True is not of type 'integer', 'string'"
    ]
    assert load_config({"shape_validation": {"alignment": None}}).shape_validation.alignment == (
        "auto"
    )


def test_scheduler_default_follows_run_target() -> None:
    config = load_config({"run": {"max_steps": 7}})
    assert config.scheduler.max_steps is None
    assert config.scheduler_steps == 7
    assert load_config({"max_steps": 9, "data": {"max_steps": 5}}).scheduler_steps == 5


def test_explicit_scheduler_max_steps_is_never_overwritten() -> None:
    # The original replaced any scheduler.max_steps equal to its default (1000).
    config = load_config({"run": {"max_steps": 10}, "scheduler": {"max_steps": 1000}})
    assert config.scheduler_steps == 1000
    reloaded = load_config(config.to_dict(), ["run.max_steps=20"])
    assert reloaded.scheduler_steps == 1000
    follows = load_config(load_config({"max_steps": 10}).to_dict(), ["max_steps=20"])
    assert follows.scheduler_steps == 20


def test_v2_config_serializes_all_new_sections() -> None:
    values = load_config(
        {
            "optimizer": {"name": "muon", "muon_plus": True},
            "shape_validation": {"alignment": 8},
            "ooo_backprop": True,
            "distributed": {"async_delta_upload": False},
        }
    ).to_dict()
    assert section(values, "optimizer")["muon_plus"] is True
    assert section(values, "shape_validation")["alignment"] == 8
    assert values["ooo_backprop"] is True
    assert section(values, "distributed")["async_delta_upload"] is False


# -- errors ------------------------------------------------------------------------------------


def test_all_errors_are_reported_at_once_with_paths() -> None:
    errors = errors_of(
        {
            "run": {"nmae": "x", "max_steps": 0},
            "lr": 0.1,
            "optimizer": {"lr": -1, "betas": [0.9, 1.5], "name": "sgd"},
            "data": {"micro_batch_size": 3, "target_batch_size": 4, "seed": "x"},
            "model": {"n_head": 3, "d_model": 32},
            "ooo_backprop": "false",
            "distributed": {"retry_initial": 5, "retry_max": 1},
        }
    )
    assert errors == [
        "data.seed: 'x' is not of type 'integer', 'null'",
        "lr: unknown key (did you mean optimizer.lr?)",
        "ooo_backprop: 'false' is not of type 'boolean'",
        "optimizer.betas[1]: 1.5 is greater than or equal to the maximum of 1",
        "optimizer.lr: -1 is less than or equal to the minimum of 0",
        "optimizer.name: 'sgd' is not one of ['adamw', 'muon']",
        "run.max_steps: 0 is less than the minimum of 1",
        "run.nmae: unknown key (did you mean 'name'?)",
        "data.target_batch_size: 4 is not divisible by data.micro_batch_size (3)",
        "model.d_model: 32 is not divisible by model.n_head (3)",
        "distributed.retry_max: 1 is less than distributed.retry_initial (5)",
    ]


def test_config_error_is_a_value_error_listing_every_problem() -> None:
    with pytest.raises(ValueError) as caught:
        load_config({"optimizer": {"lr": -1}, "run": {"seed": -1}})
    error = caught.value
    assert isinstance(error, ConfigError)
    assert len(error.errors) == 2
    assert "2 configuration errors" in str(error)
    assert all(message in str(error) for message in error.errors)


def test_quoted_false_is_a_type_error_not_truthy() -> None:
    assert errors_of({"gradient_checkpointing": "false"}) == [
        "gradient_checkpointing: 'false' is not of type 'boolean'"
    ]
    assert errors_of({"compile": "false"}) == [
        "compile: 'false' is not of type 'boolean', 'object'"
    ]
    assert errors_of({"checkpoint": {"enabled": "no"}}) == [
        "checkpoint.enabled: 'no' is not of type 'boolean'"
    ]


def test_string_where_an_int_is_expected_is_a_config_error() -> None:
    # The original compared "2" with an int and crashed with TypeError.
    assert errors_of({"data": {"micro_batch_size": 2, "target_batch_size": "4"}}) == [
        "data.target_batch_size: '4' is not of type 'integer', 'null'"
    ]
    # micro_batch_size takes an int or "auto": any other string is refused.
    assert errors_of({"data": {"micro_batch_size": "2", "target_batch_size": 4}}) == [
        "data.micro_batch_size: '2' is not 'auto' or an integer"
    ]
    with pytest.raises(ConfigError):
        RunConfig(max_steps="5")  # type: ignore[arg-type]  # the point of the test
    assert errors_of({"model": {"d_model": "wide", "n_head": 4}}) == [
        "model.d_model: 'wide' is not of type 'integer'"
    ]


def test_wrong_types_anywhere_never_crash() -> None:
    assert errors_of({"run": [1, 2]}) == ["run: [1, 2] is not of type 'object'"]
    assert errors_of({"optimizer": 5, "muon_plus": True}) == [
        "optimizer: 5 is not of type 'object'"
    ]
    assert errors_of({"callbacks": {"name": PROBE}}) == [
        f"callbacks: {{'name': '{PROBE}'}} is not of type 'array'"
    ]
    assert errors_of({"callbacks": [{"every_steps": 1}, 3]}) == [
        "callbacks[0]: 'name' is a required property",
        "callbacks[1]: 3 is not of type 'object'",
    ]
    assert errors_of({"imports": "os"}) == ["imports: 'os' is not of type 'array'"]
    assert errors_of([1, 2])[0].startswith("<root>: cannot load a configuration from list")
    with pytest.raises(ConfigError, match="root must be a mapping, got list"):
        SpeedtronicConfig.from_dict([1, 2])  # type: ignore[arg-type]  # the point of the test
    assert errors_of("- 1\n- 2\n") == ["<root>: configuration root must be a mapping, got list"]


def test_non_finite_numbers_are_rejected() -> None:
    assert errors_of("optimizer: {lr: .nan}") == ["optimizer.lr: nan is not a finite number"]
    assert errors_of({"distributed": {"poll_interval": float("inf")}}) == [
        "distributed.poll_interval: inf is not a finite number"
    ]


def test_model_head_rules() -> None:
    assert errors_of({"model": {"n_head": 8, "n_kv_head": 3}}) == [
        "model.n_head: 8 is not divisible by model.n_kv_head (3)"
    ]
    with pytest.raises(ConfigError, match="model.d_model"):
        ModelConfig(d_model=30, n_head=4)
    assert ModelConfig(d_model=32, n_head=4).d_ff == 128


def test_distributed_rules() -> None:
    assert errors_of({"distributed": {"enabled": True}}) == [
        "distributed.repo_id: required when distributed.enabled is true "
        "(or set distributed.hub_dir for a shared-directory hub)"
    ]
    assert errors_of({"distributed": {"enabled": True, "repo_id": "o/r", "hub_dir": "/x"}}) == [
        "distributed.hub_dir: set distributed.repo_id or distributed.hub_dir, not both"
    ]
    assert errors_of({"distributed": {"enabled": True, "repo_id": "o/r", "mode": "single"}}) == [
        "distributed.mode: must be 'dumb_diloco' when distributed.enabled is true (got 'single')"
    ]
    assert errors_of({"distributed": {"node_id": "a/b", "collaborators": ["ok", " "]}}) == [
        "distributed.node_id: 'a/b' must not contain '/' or '\\'",
        "distributed.collaborators[1]: must not be blank",
    ]
    assert errors_of({"distributed": {"node_id": ".."}}) == [
        "distributed.node_id: '..' is not a valid node id"
    ]
    assert errors_of({"distributed": {"delta_upload_queue_size": 2}}) == [
        "distributed.delta_upload_queue_size: 2 is not one of [1]"
    ]
    assert load_config({"distributed": {"node_id": " n1 "}}).distributed.node_id == "n1"


def test_pickled_dataset_paths_are_refused() -> None:
    assert errors_of({"data": {"dataset": "data/train.pt"}}) == [
        "data.dataset: 'data/train.pt' looks like a pickled dataset file; name a registered "
        "dataset instead (pickle files are never loaded)"
    ]
    # A registered name passes with its free-form options (an unknown one is an error, with
    # the other plugin names: test_plugin_names_are_checked_with_the_keys).
    dataset_registry.register("tiny_shakespeare", lambda request: TensorDataset())
    try:
        config = load_config({"data": {"dataset": "tiny_shakespeare", "dataset_options": {"n": 1}}})
    finally:
        dataset_registry.unregister("tiny_shakespeare")
    assert config.data.dataset == "tiny_shakespeare"
    assert config.data.dataset_options == {"n": 1}
    assert errors_of({"data": {"dataset_options": {"n": object}}})[0].startswith(
        "data.dataset_options.n: type is not a JSON value"
    )


# -- shorthands and normalisation ----------------------------------------------------------


def test_root_shorthands() -> None:
    config = load_config(
        {
            "name": "n",
            "seed": 7,
            "device": "cpu",
            "output_dir": "out",
            "max_steps": 3,
            "log_every": 2,
            "precision": "BF16",
            "compile": True,
            "gradient_checkpointing": True,
        }
    )
    assert (config.run.name, config.run.seed, config.run.device) == ("n", 7, "cpu")
    assert (config.run.output_dir, config.run.max_steps) == ("out", 3)
    assert config.logging.every_steps == 2
    assert config.precision.mode == "bf16"
    assert config.compile is True
    assert config.model.gradient_checkpointing is True
    assert load_config({"model": {"gradient_checkpointing": True}}).gradient_checkpointing
    assert load_config({"compile": {"enabled": False}}).compile is False
    assert errors_of({"compile": {"enable": True}}) == [
        "compile.enable: unknown key (did you mean 'enabled'?)"
    ]


def test_alias_conflicts_are_errors() -> None:
    assert errors_of({"muon_plus": True, "optimizer": {"name": "muon", "muon_plus": False}}) == [
        "muon_plus: conflicts with optimizer.muon_plus (True vs False)"
    ]
    assert errors_of({"max_steps": 5, "run": {"max_steps": 6}}) == [
        "max_steps: conflicts with run.max_steps (5 vs 6)"
    ]
    assert errors_of({"hub": {}, "distributed": {}}) == [
        "hub: alias of distributed, which is also given"
    ]
    assert errors_of({"log_every": 5, "logging": {"every_steps": 10}}) == [
        "run.log_every: conflicts with logging.every_steps (5 vs 10)"
    ]
    # The same value twice is not a conflict.
    assert load_config({"cautious": True, "optimizer": {"cautious": True}}).optimizer.cautious


def test_derived_defaults() -> None:
    config = load_config({"seed": 9, "model": {"vocab_size": 64, "max_seq_len": 16}})
    assert config.data.block_size == 16
    assert config.data.vocab_size == 64
    assert config.data.seed == 9
    assert config.model.n_kv_head == config.model.n_head
    assert config.target_steps == 1000
    explicit = load_config({"data": {"block_size": 8, "seed": 1}})
    assert (explicit.data.block_size, explicit.data.seed) == (8, 1)


def test_enumerated_strings_are_case_insensitive() -> None:
    config = load_config(
        {"optimizer": " MuOn ", "scheduler": {"name": "Constant"}, "logging": {"level": "debug"}}
    )
    assert config.optimizer.name == "muon"
    assert config.scheduler.name == "constant"
    assert config.logging.level == "DEBUG"
    assert errors_of({"logging": {"level": "verbose"}}) == [
        "logging.level: 'VERBOSE' is not one of ['DEBUG', 'INFO', 'WARNING', 'ERROR', 'CRITICAL']"
    ]


def test_v2_keys_and_defaults() -> None:
    config = SpeedtronicConfig()
    optimizer = config.optimizer
    assert optimizer.muon_plus_mode == "row_col" and optimizer.muon_lr_scale == "rms"
    assert optimizer.muon_nesterov is True and optimizer.cautious_rescale is False
    assert optimizer.muon_ns_coefficients == (3.4445, -4.775, 2.0315)
    assert optimizer.resolved_muon_lr == optimizer.lr
    assert optimizer.resolved_muon_weight_decay == optimizer.weight_decay
    assert (config.logging.console, config.logging.jsonl) == (True, True)
    checkpoint = config.checkpoint
    assert (checkpoint.async_save, checkpoint.save_on_exception) == (False, False)
    assert (checkpoint.save_on_signal, checkpoint.load_callback_state) == (True, True)
    assert config.distributed.timeout_s == 1800.0
    assert config.data.synthetic_kind == "uniform" and config.data.dataset_options == {}
    assert config.callbacks == [] and config.imports == []
    tuned = load_config(
        {"optimizer": {"muon_lr": 0.02, "muon_weight_decay": 0, "muon_lr_scale": "rms"}}
    )
    assert tuned.optimizer.resolved_muon_lr == 0.02
    assert tuned.optimizer.resolved_muon_weight_decay == 0.0
    assert errors_of({"optimizer": {"muon_ns_coefficients": [1, 2]}}) == [
        "optimizer.muon_ns_coefficients: [1, 2] is too short"
    ]
    assert errors_of({"data": {"synthetic_kind": "zipf"}}) == [
        "data.synthetic_kind: 'zipf' is not one of ['uniform', 'learnable']"
    ]


def test_routing_rules() -> None:
    config = load_config(
        {"optimizer": {"name": "muon", "routing": [{"to": "adamw", "name": "*.head.*"}]}}
    )
    rule = config.optimizer.routing[0]
    assert rule == RoutingRule(to="adamw", name="*.head.*")
    assert rule.to_dict() == {"to": "adamw", "name": "*.head.*"}
    assert errors_of({"optimizer": {"routing": [{"to": "sgd", "nmae": "x"}, {"name": "x"}]}}) == [
        "optimizer.routing[0].nmae: unknown key (did you mean 'name'?)",
        "optimizer.routing[0].to: 'sgd' is not one of ['muon', 'adamw']",
        "optimizer.routing[1]: 'to' is a required property",
    ]
    assert errors_of({"optimizer": {"routing": [{"to": "muon", "ndim": 1}]}}) == [
        "optimizer.routing[0].ndim: Muon updates matrices only, a rule sending ndim 1 to "
        "'muon' can never apply"
    ]


# -- callbacks and imports -----------------------------------------------------------------


def test_callbacks_are_typed_and_validated_by_their_plugin_schema() -> None:
    config = load_config({"callbacks": [{"name": PROBE, "every_steps": 5}, PROBE]})
    assert config.callbacks == [
        CallbackSpec(name=PROBE, options={"every_steps": 5}),
        CallbackSpec(name=PROBE),
    ]
    errors = errors_of(
        {
            "callbacks": [
                {"name": PROBE, "every_steps": 0, "lable": "x"},
                {"name": "no-such-plugin"},
            ],
            "optimizer": {"lr": 0},
        }
    )
    assert errors[0].startswith("callbacks[1].name: unknown callback 'no-such-plugin' (known: ")
    assert PROBE in errors[0]
    assert errors[1:] == [
        "callbacks[0].every_steps: 0 is less than the minimum of 1",
        "callbacks[0].lable: unknown key (did you mean 'label'?)",
        "optimizer.lr: 0 is less than or equal to the minimum of 0",
    ]


def test_callback_spec_validation_on_direct_construction() -> None:
    with pytest.raises(ConfigError, match=r"callbacks\[0\].every_steps"):
        SpeedtronicConfig(callbacks=[CallbackSpec(PROBE, {"every_steps": -1})])
    with pytest.raises(ConfigError, match="clashes with the plugin name"):
        CallbackSpec(PROBE, {"name": "x"})


def test_imports_make_a_user_callback_visible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = f"user_plugins_{uuid.uuid4().hex}"
    plugin = f"user-cb-{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(
            f"""
            from speedtronic.engine.callback import Callback
            from speedtronic.plugins import register_callback

            @register_callback({plugin!r})
            class UserCallback(Callback):
                options_schema = {{
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {{"level": {{"type": "integer"}}}},
                }}
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = {"name": plugin, "level": 3}
    assert errors_of({"callbacks": [entry]})[0].startswith(
        f"callbacks[0].name: unknown callback {plugin!r}"
    )
    config = load_config({"imports": [module], "callbacks": [entry]})
    assert config.imports == [module]
    assert config.callbacks == [CallbackSpec(plugin, {"level": 3})]
    assert errors_of({"imports": [module], "callbacks": [{"name": plugin, "level": "3"}]}) == [
        "callbacks[0].level: '3' is not of type 'integer'"
    ]


def test_failing_import_is_reported_at_its_index() -> None:
    errors = errors_of({"imports": ["json", "no_such_module_for_speedtronic_tests"]})
    assert len(errors) == 1
    assert errors[0].startswith(
        "imports[1]: cannot import 'no_such_module_for_speedtronic_tests': "
    )


# -- sources -------------------------------------------------------------------------------


def test_every_source_kind_gives_the_same_config(tmp_path: Path) -> None:
    values = {"run": {"name": "src", "max_steps": 3}, "optimizer": {"lr": 0.001}}
    yaml_path = tmp_path / "run.yml"
    yaml_path.write_text("run: {name: src, max_steps: 3}\noptimizer:\n  lr: 1e-3\n")
    json_path = tmp_path / "run.json"
    json_path.write_text(json.dumps(values))
    expected = load_config(values)
    assert expected.optimizer.lr == 0.001
    for source in (
        yaml_path,
        str(yaml_path),
        json_path,
        "run: {name: src, max_steps: 3}\noptimizer: {lr: 1.0e-3}\n",
        json.dumps(values),
        expected,
    ):
        assert load_config(source) == expected
    assert SpeedtronicConfig.from_yaml(yaml_path) == expected
    assert Config is SpeedtronicConfig


def test_empty_sources_mean_defaults(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty) == SpeedtronicConfig()
    assert load_config(None) == SpeedtronicConfig()
    assert load_config({"model": None, "callbacks": None}) == SpeedtronicConfig()


def test_bad_files_are_config_errors_naming_the_file(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("run: {name: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML") as caught:
        load_config(broken)
    assert str(broken) in str(caught.value)
    duplicate = tmp_path / "dup.yaml"
    duplicate.write_text("optimizer:\n  lr: 0.1\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match="duplicate key 'lr'"):
        load_config(duplicate)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{")
    with pytest.raises(ConfigError, match="invalid JSON"):
        load_config(bad_json)
    invalid = tmp_path / "invalid.yaml"
    invalid.write_text("optimizer: {lr: -1}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(invalid)
    assert str(invalid) in str(caught.value)
    assert caught.value.errors == ["optimizer.lr: -1 is less than or equal to the minimum of 0"]
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "missing.yaml")


def test_schema_key_is_accepted_for_editors() -> None:
    config = load_config({"$schema": "./schemas/run.schema.json", "max_steps": 2})
    assert config.run.max_steps == 2


# -- overrides -----------------------------------------------------------------------------


def test_override_values_are_typed() -> None:
    config = load_config(
        {"run": {"name": "base"}},
        [
            "optimizer.lr=1e-3",
            "run.name=x",
            "checkpoint.enabled=false",
            "checkpoint.keep_last=null",
            "optimizer.betas=[0.8, 0.9]",
            "optimizer.betas[1]=0.99",
            f"callbacks=[{{name: {PROBE}, every_steps: 2}}]",
            "callbacks[0].label=hello world",
        ],
    )
    assert config.optimizer.lr == 0.001
    assert config.run.name == "x"
    assert config.checkpoint.enabled is False and config.checkpoint.keep_last is None
    assert config.optimizer.betas == (0.8, 0.99)
    assert config.callbacks == [CallbackSpec(PROBE, {"every_steps": 2, "label": "hello world"})]


def test_overrides_beat_every_spelling_in_the_file() -> None:
    base = {"max_steps": 7, "optimizer": "muon", "hub": {"repo_id": "a/b"}, "log_every": 10}
    config = load_config(
        base,
        ["run.max_steps=5", "optimizer.lr=0.1", "hub.repo_id=c/d", "logging.every_steps=3"],
    )
    assert config.run.max_steps == 5
    assert (config.optimizer.name, config.optimizer.lr) == ("muon", 0.1)
    assert config.distributed.repo_id == "c/d"
    assert config.logging.every_steps == 3
    assert load_config({"run": {"max_steps": 7}}, ["max_steps=4"]).run.max_steps == 4
    muon = load_config({"muon_plus": False}, ["optimizer=muon", "muon_plus=true"])
    assert muon.optimizer.muon_plus
    assert load_config({"log_every": 10}, ["log_every=4"]).logging.every_steps == 4
    assert load_config({"compile": True}, ["compile.enabled=false"]).compile is False
    assert load_config({}, ["precision=fp32"]).precision.mode == "fp32"


def test_overridden_values_are_validated() -> None:
    assert errors_of({}, ("optimizer.lr=-1", "run.nmae=x")) == [
        "optimizer.lr: -1 is less than or equal to the minimum of 0",
        "run.nmae: unknown key (did you mean 'name'?)",
    ]


def test_malformed_overrides_name_themselves() -> None:
    for text in ("foo", "=1", "a..b=1", "a.[0]=1", "[0]=1", "a[x]=1"):
        with pytest.raises(ConfigError) as caught:
            apply_overrides({}, [text])
        assert repr(text) in str(caught.value)
    with pytest.raises(ConfigError, match="run.name is str, not a mapping"):
        apply_overrides({"run": {"name": "x"}}, ["run.name.first=1"])
    with pytest.raises(ConfigError, match=r"index 2 is out of range for callbacks \(1 items\)"):
        apply_overrides({"callbacks": [PROBE]}, ["callbacks[2].x=1"])
    with pytest.raises(ConfigError, match="invalid YAML"):
        apply_overrides({}, ["run.name=[unclosed"])


def test_parse_override_and_apply_leave_the_input_alone() -> None:
    assert parse_override("callbacks[0].every_steps=10") == (["callbacks", 0, "every_steps"], 10)
    assert parse_override("run.name=") == (["run", "name"], None)
    base = {"optimizer": {"lr": 0.1}}
    assert apply_overrides(base, ["optimizer.lr=0.2"]) == {"optimizer": {"lr": 0.2}}
    assert base == {"optimizer": {"lr": 0.1}}


def test_overrides_on_a_config_object_build_a_new_one() -> None:
    config = load_config({"distributed": {"repo_id": "o/r", "token": "tok"}})
    changed = load_config(config, ["run.name=changed"])
    assert changed.run.name == "changed" and config.run.name == "speedtronic-run"
    assert changed.distributed.token == "tok"
    assert load_config(config) is config


# -- direct construction and mutation ------------------------------------------------------


def test_direct_construction_is_validated_and_coerced() -> None:
    with pytest.raises(ConfigError, match="not divisible"):
        DataConfig(micro_batch_size=3, target_batch_size=4)
    # Deliberately loose types: a list for the betas tuple, a mapping for a RoutingRule.
    optimizer = OptimizerConfig(
        lr=1,
        betas=[0.8, 0.9],  # type: ignore[arg-type]  # coerced to a tuple
        routing=[{"to": "muon"}],  # type: ignore[list-item]  # coerced to a RoutingRule
    )
    assert isinstance(optimizer.lr, float) and optimizer.betas == (0.8, 0.9)
    assert optimizer.routing == [RoutingRule(to="muon")]
    run = RunConfig(max_steps=5, output_dir=Path("out"))  # type: ignore[arg-type]  # coerced to str
    config = SpeedtronicConfig(run=run)
    assert config.run.output_dir == "out" and config.scheduler_steps == 5


def test_validate_after_mutation() -> None:
    config = SpeedtronicConfig()
    config.data.micro_batch_size = 3
    config.optimizer.lr = -1.0
    with pytest.raises(ConfigError) as caught:
        config.validate()
    assert caught.value.errors == [
        "optimizer.lr: -1.0 is less than or equal to the minimum of 0",
        "data.target_batch_size: 1 is less than data.micro_batch_size (3)",
    ]


def test_section_from_dict() -> None:
    assert RunConfig.from_dict({"name": "x"}).name == "x"
    with pytest.raises(ConfigError, match="run.nmae: unknown key"):
        RunConfig.from_dict({"nmae": "x"})


def test_sections_may_be_given_as_mappings_and_wrong_types_are_errors() -> None:
    config = SpeedtronicConfig(run={"name": "m"})  # type: ignore[arg-type]  # the point of the test
    assert config.run == RunConfig(name="m")
    with pytest.raises(ConfigError, match="run: expected a RunConfig or a mapping, got int"):
        SpeedtronicConfig(run=3)  # type: ignore[arg-type]  # the point of the test


def test_free_form_secrets_stay_out_of_reprs() -> None:
    config = load_config(
        {"data": {"dataset": "synthetic", "dataset_options": {"api_key": "k-123"}}}
    )
    assert "k-123" not in repr(config)
    assert config.data.dataset_options == {"api_key": "k-123"}


def test_target_batch_defaults_to_micro_batch() -> None:
    from speedtronic.config import SpeedtronicConfig

    config = SpeedtronicConfig.from_dict({"data": {"micro_batch_size": 8}})
    assert config.data.target_batch_size == 8
    assert config.accumulation_steps == 1


def test_data_vocab_larger_than_model_vocab_is_an_error() -> None:
    import pytest

    from speedtronic.config import ConfigError, SpeedtronicConfig

    with pytest.raises(ConfigError, match=r"data.vocab_size: 300 is larger than model.vocab_size"):
        SpeedtronicConfig.from_dict({"model": {"vocab_size": 256}, "data": {"vocab_size": 300}})


def test_a_config_is_validated_once_and_again_only_when_it_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import speedtronic.config.validation as schema
    from speedtronic.runtime import as_config

    passes: list[object] = []
    check = schema._schema_errors

    def counted(validator: object, data: object) -> list[tuple[str, str]]:
        passes.append(data)
        return check(validator, data)  # type: ignore[arg-type]  # the validator passed through

    monkeypatch.setattr(schema, "_schema_errors", counted)
    built = SpeedtronicConfig(run=RunConfig.from_dict({"max_steps": 5}))  # the section's pass
    assert len(passes) == 2  # ... and the whole config's, once
    loaded = load_config({"run": {"max_steps": 5}, "log_every": 2})
    assert len(passes) == 3 and loaded.logging.every_steps == 2
    assert as_config(loaded) is loaded and as_config(built) is built
    assert load_config(loaded) is loaded
    assert len(passes) == 3  # unchanged since validated: not checked again
    loaded.run.max_steps = 0
    with pytest.raises(ConfigError, match="run.max_steps: 0 is less than the minimum of 1"):
        as_config(loaded)
    assert len(passes) == 4


def test_a_mistyped_plugin_name_is_hinted_by_its_family_when_difflib_finds_none() -> None:
    # ``hf_lama`` is too far from ``hf_causal_lm`` for difflib (ratio 0.6), but it is the
    # only ``hf_`` model: the hint names it. A family of several gets no guess.
    hint = r"unknown model 'hf_lama' \(did you mean 'hf_causal_lm'\?"
    with pytest.raises(ConfigError, match=hint):
        load_config({"model": {"name": "hf_lama"}})
    assert closest_name("hf_lama", ["hf_causal_lm", "reference_transformer"]) == "hf_causal_lm"
    assert closest_name("hf_lama", ["hf_causal_lm", "hf_seq2seq"]) is None
    assert closest_name("zzz", ["hf_causal_lm"]) is None
