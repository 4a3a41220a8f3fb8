"""Validation of a configuration: the schema errors, imports and plugin names, and the
cross-field rules.

``config_errors`` is the single validation entry point: imports, plugin lookup, schema and
cross-field rules, every problem as one ``"<path>: <message>"`` string.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol, cast

from jsonschema import Draft202012Validator, ValidationError
from jsonschema.exceptions import SchemaError

from speedtronic import plugins
from speedtronic.config.schema import (
    PICKLE_SUFFIXES,
    OversizedNumber,
    base,
    callback_entry_schema,
    composed_validator,
    format_path,
    mapping_or_empty,
    oversized_integer,
    plugin_root_keys,
    root_default,
    section_defaults,
    section_schema,
)
from speedtronic.errors import ConfigError as ConfigError

# -- validation -------------------------------------------------------------------------


def config_errors(data: Mapping[str, object], *, imported: bool = False) -> list[str]:
    """Every problem of a normalised configuration mapping (see ``loading.normalise``).

    Order: ``imports`` first (they may register the plugins that follow; ``imported``: the
    caller has imported them already, with ``import_errors``), then plugin names
    (callbacks, the model, datasets, the collate function: an unknown one with the closest
    known name), then the composed-schema pass, non-finite or non-JSON values, and the
    cross-field rules. Nothing is imported except the listed ``imports``.
    """
    data, oversized = _without_oversized_numbers(data)
    errors = [] if imported else import_errors(data.get("imports"))
    plugin_schemas, plugin_errors = _referenced_plugin_schemas(data.get("callbacks"))
    errors.extend(plugin_errors)
    errors.extend(_plugin_name_errors(_Values(data)))
    # A number too long to be anything is reported as that, not as a type mismatch.
    schema_errors = [
        (path, message)
        for path, message in _schema_errors(composed_validator(plugin_schemas), data)
        if path not in oversized
    ]
    errors.extend(message for _, message in schema_errors)
    errors.extend(oversized.values())
    reported = {path for path, _ in schema_errors} | set(oversized)
    errors.extend(
        message
        for path, message in _value_errors(data)
        if not any(path == seen or path.startswith(seen + ".") for seen in reported)
    )
    errors.extend(cross_field_errors(data))
    return errors


def _without_oversized_numbers(
    data: Mapping[str, object],
) -> tuple[Mapping[str, object], dict[str, str]]:
    """``data`` with every Python int wider than ``MAX_INTEGER_BITS`` replaced by an
    ``OversizedNumber`` (a copy, only when there is one: the schema's messages would print
    its digits), and the path -> message of every oversized number in it."""
    found: dict[str, str] = {}

    def walk(value: object, parts: tuple[str | int, ...]) -> object:
        number = OversizedNumber.of_int(value) if oversized_integer(value) else value
        if isinstance(number, OversizedNumber):
            path = format_path(parts)
            found[path] = f"{path}: {number.describe()}"
            return number
        if isinstance(value, Mapping):
            return {key: walk(item, (*parts, str(key))) for key, item in value.items()}
        if isinstance(value, list):
            return [walk(item, (*parts, index)) for index, item in enumerate(value)]
        return value

    cleaned = walk(data, ())
    if not found:
        return data, found
    return cast(Mapping[str, object], cleaned), found


def import_errors(imports: object) -> list[str]:
    """Import the modules of an ``imports:`` list; one message per module that fails
    (``imports[i]: cannot import ...``). A value that is no list is left to the schema."""
    if not isinstance(imports, list):
        return []  # a wrong type is reported by the schema
    errors: list[str] = []
    for index, module in enumerate(imports):
        if not isinstance(module, str) or not module:
            continue
        try:
            plugins.import_modules([module])
        except plugins.PluginError as exc:
            reason = exc.__cause__ if exc.__cause__ is not None else exc
            errors.append(f"imports[{index}]: cannot import {module!r}: {reason}")
    return errors


def _referenced_plugin_schemas(
    callbacks: object,
) -> tuple[dict[str, Mapping[str, object]], list[str]]:
    """Options schemas of the plugins named in ``callbacks:`` plus errors for unknown
    names and broken plugin schemas (each reported at ``callbacks[i].name``)."""
    if not isinstance(callbacks, list):
        return {}, []
    found: dict[str, Mapping[str, object]] = {}
    errors: list[str] = []
    for index, entry in enumerate(callbacks):
        name = entry.get("name") if isinstance(entry, Mapping) else None
        if not isinstance(name, str) or not name or name in found:
            continue  # missing or ill-typed names are reported by the schema
        try:
            options_schema = plugins.callback_options_schema(name)
        except plugins.PluginError as exc:
            errors.append(f"callbacks[{index}].name: {exc}")
            continue
        problem = _plugin_schema_problem(name, options_schema)
        if problem is not None:
            errors.append(f"callbacks[{index}].name: {problem}")
            continue
        found[name] = options_schema
    return found, errors


class _KnownNames(Protocol):
    """What the name check needs of a registry (``plugins.PluginRegistry``, any item type)."""

    def __contains__(self, name: object) -> bool: ...

    def unknown(self, name: str) -> str: ...


def _plugin_name_errors(values: _Values) -> Iterator[str]:
    """``model.name``, ``data.dataset``, ``eval.dataset`` and ``data.collate`` naming what
    no registry (nor entry point) knows. Ill-typed values are the schema's to report, a
    dataset name that looks like a file the data rules'."""
    from speedtronic.data.collate import collate_registry
    from speedtronic.data.loader import dataset_registry
    from speedtronic.models.registry import registry

    named: tuple[tuple[str, str, _KnownNames], ...] = (
        ("model", "name", registry),
        ("data", "dataset", dataset_registry),
        ("eval", "dataset", dataset_registry),
        ("data", "collate", collate_registry),
    )
    for section, key, registry_of_names in named:
        name = values.text(section, key)
        if name is None or name in registry_of_names or _looks_like_a_file(name):
            continue
        yield f"{section}.{key}: {registry_of_names.unknown(name)}"


def _looks_like_a_file(name: str) -> bool:
    return name.lower().endswith(PICKLE_SUFFIXES) or "/" in name or "\\" in name


def _plugin_schema_problem(name: str, options_schema: object) -> str | None:
    if not isinstance(options_schema, Mapping):
        return f"callback {name!r} has an options schema that is not a mapping"
    try:
        Draft202012Validator.check_schema(callback_entry_schema(name, options_schema))
    except SchemaError as exc:
        return f"callback {name!r} has an invalid options schema: {exc.message}"
    except (TypeError, ValueError) as exc:  # not JSON-serialisable
        return f"callback {name!r} has an invalid options schema: {exc}"
    return None


def _schema_errors(validator: Draft202012Validator, data: object) -> list[tuple[str, str]]:
    """(path, message) for every schema violation, sorted by path."""
    found: list[tuple[str, str]] = []
    for error in validator.iter_errors(data):
        found.extend(_describe(error))
    return sorted(set(found), key=lambda item: item[0])


def _describe(error: ValidationError) -> Iterator[tuple[str, str]]:
    branch = _the_branch_of_its_type(error)
    if branch:  # say what the value broke there, not "not valid under any of the given schemas"
        for sub_error in branch:
            yield from _describe(sub_error)
        return
    parts = list(error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, Mapping):
        allowed = tuple(mapping_or_empty(mapping_or_empty(error.schema).get("properties")))
        for key in error.instance:
            if key not in allowed:
                path = format_path([*parts, key]) if isinstance(key, str) else format_path(parts)
                yield path, f"{path}: unknown key{_suggestion(key, allowed, parts)}"
        return
    path = format_path(parts)
    yield path, f"{path}: {_shortened(_alternatives(error) or error.message)}"


def _the_branch_of_its_type(error: ValidationError) -> list[ValidationError]:
    """For a value no branch of an ``anyOf``/``oneOf`` accepts (``int | "auto"``): the errors
    of the one branch whose type or constant the value has, when exactly one has it (``1e11``
    is an integer over the maximum, not a wrong ``"auto"``); else none."""
    if error.validator not in ("anyOf", "oneOf") or not error.context:
        return []
    branches: dict[object, list[ValidationError]] = {}
    for sub_error in error.context:
        branches.setdefault(sub_error.relative_schema_path[0], []).append(sub_error)
    of_its_type = [
        errors
        for errors in branches.values()
        if not any(e.validator in ("type", "const", "enum") for e in errors)
    ]
    return of_its_type[0] if len(of_its_type) == 1 else []


_TYPE_NAMES = {"integer": "an integer", "number": "a number", "string": "a string"}


def _alternatives(error: ValidationError) -> str | None:
    """``'x' is not 'auto' or an integer``, for an ``anyOf``/``oneOf`` of constants and
    simple types that no branch accepts."""
    if error.validator not in ("anyOf", "oneOf") or not isinstance(error.validator_value, list):
        return None
    names = []
    for branch in error.validator_value:
        if isinstance(branch, Mapping) and "const" in branch:
            names.append(repr(branch["const"]))
        elif isinstance(branch, Mapping) and branch.get("type") in _TYPE_NAMES:
            names.append(_TYPE_NAMES[str(branch["type"])])
        else:
            return None
    return f"{error.instance!r} is not {' or '.join(names)}"


_MESSAGE_CHARS = 300


def _shortened(message: str) -> str:
    """A schema message cut in the middle when long: jsonschema quotes the whole value, and
    a value may be a string of a megabyte."""
    if len(message) <= _MESSAGE_CHARS:
        return message
    return f"{message[:160]} ... {message[-100:]} ({len(message):,} characters)"


def _suggestion(key: object, allowed: Sequence[str], parts: Sequence[str | int]) -> str:
    if not isinstance(key, str):
        return f" {key!r} (keys must be strings)"
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.75)
    if close:
        return f" (did you mean {close[0]!r}?)"
    if not parts:  # a section key written at the root: point at its section
        sections = [name for name, spec in mapping_or_empty(base().get("properties")).items()]
        homes = [section for section in sections if key in section_schema(base(), section)]
        if homes:
            return f" (did you mean {homes[0]}.{key}?)"
    return ""


def _value_errors(data: object, parts: tuple[str | int, ...] = ()) -> Iterator[tuple[str, str]]:
    """Non-finite numbers anywhere and non-JSON values in free-form option mappings
    (``data.dataset_options`` and callback options), which the schema cannot see."""
    free_form = _is_free_form(parts)
    if isinstance(data, float) and not math.isfinite(data):
        path = format_path(parts)
        yield path, f"{path}: {data!r} is not a finite number"
    elif isinstance(data, Mapping):
        for key, value in data.items():
            if free_form and not isinstance(key, str):
                path = format_path(parts)
                yield path, f"{path}: key {key!r} is not a string"
                continue
            yield from _value_errors(value, (*parts, str(key)))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            yield from _value_errors(value, (*parts, index))
    elif free_form and not isinstance(data, (str, int, float, bool, type(None))):
        path = format_path(parts)
        yield path, f"{path}: {type(data).__name__} is not a JSON value"


def _is_free_form(parts: tuple[str | int, ...]) -> bool:
    free_form = (("data", "dataset_options"), ("eval", "dataset_options"), ("model", "options"))
    if parts[:2] in free_form:
        return True
    return len(parts) >= 2 and parts[0] == "callbacks"


# -- cross-field rules ------------------------------------------------------------------


class _Values:
    """Typed access to a (possibly ill-typed) normalised config with schema defaults.

    Each getter returns ``None`` when the value is absent-with-null-default or has the wrong
    type: the schema already reports wrong types, so a rule simply does not run on them.
    """

    def __init__(self, data: Mapping[str, object]) -> None:
        self._data = data

    def get(self, section: str, key: str) -> object:
        values = self._data.get(section, {})
        if not isinstance(values, Mapping):
            return None
        if key in values:
            return values[key]
        return section_defaults(section, plugins.callback_registry.version).get(key)  # read-only

    def get_root(self, key: str) -> object:
        """A top-level value as given (``None`` when absent)."""
        return self._data.get(key)

    def integer(self, section: str, key: str) -> int | None:
        value = self.get(section, key)
        if isinstance(value, bool):
            return None
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value if isinstance(value, int) else None

    def positive_int(self, section: str, key: str) -> int | None:
        value = self.integer(section, key)
        return value if value is not None and value > 0 else None

    def number(self, section: str, key: str) -> float | None:
        value = self.get(section, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        return float(value)

    def text(self, section: str, key: str) -> str | None:
        value = self.get(section, key)
        return value if isinstance(value, str) else None

    def flag(self, section: str, key: str) -> bool:
        return self.get(section, key) is True

    def plugin_sections(self, spec: plugins.PluginSpec) -> dict[str, object]:
        """The top-level keys a plugin reads, schema defaults filled in."""
        root = mapping_or_empty(base().get("properties"))
        found: dict[str, object] = {}
        for key in spec.sections.keys:
            if "properties" in mapping_or_empty(root.get(key)):  # a section: defaults under values
                defaults = section_defaults(key, plugins.callback_registry.version)
                found[key] = {**defaults, **mapping_or_empty(self._data.get(key))}
            else:
                found[key] = self._data[key] if key in self._data else root_default(key)
        return found

    def callback_entries(self) -> list[tuple[int, Mapping[str, object]]]:
        """``(index, entry)`` of every well-formed ``callbacks:`` entry."""
        entries = self._data.get("callbacks")
        if not isinstance(entries, list):
            return []
        return [(i, entry) for i, entry in enumerate(entries) if isinstance(entry, Mapping)]


def cross_field_errors(data: Mapping[str, object]) -> list[str]:
    """Rules that relate several keys (or need more than a JSON Schema keyword)."""
    values = _Values(data)
    errors: list[str] = []
    for rule in (
        _batch_rules,
        _model_rules,
        _optimizer_rules,
        _data_rules,
        _eval_monitor_rules,
        _parallel_rules,
    ):
        errors.extend(rule(values))
    errors.extend(_plugin_rules(values))
    return errors


def _batch_rules(values: _Values) -> Iterator[str]:
    micro = values.positive_int("data", "micro_batch_size")
    target = values.positive_int("data", "target_batch_size")
    if micro is None or target is None:
        return
    if target < micro:
        yield f"data.target_batch_size: {target} is less than data.micro_batch_size ({micro})"
    elif target % micro:
        yield (
            f"data.target_batch_size: {target} is not divisible by data.micro_batch_size ({micro})"
        )


def _model_rules(values: _Values) -> Iterator[str]:
    """The model plugin's rules: ``model.options`` against the factory's ``options_schema``,
    and the reference transformer's dimension rules (for that model only). An unknown model
    name is reported with the other plugin names (``_plugin_name_errors``)."""
    from speedtronic.models.registry import registry

    name = values.text("model", "name")
    if name is None or name not in registry:
        return
    try:
        factory = registry.get(name)
    except plugins.PluginError as exc:
        yield f"model.name: {exc}"
        return
    options = values.get("model", "options")
    options_schema = registry.options_schema(name)
    if options_schema is not None and isinstance(options, Mapping):
        try:
            validator = Draft202012Validator(dict(options_schema))
            found = [
                message
                for error in validator.iter_errors(options)
                for _, message in _describe_under(error, ("model", "options"))
            ]
        except (SchemaError, TypeError, ValueError) as exc:
            found = [f"model.name: model {name!r} has an invalid options schema: {exc}"]
        yield from sorted(set(found))
    if _is_reference_transformer(factory):
        yield from _reference_transformer_rules(values)
        yield from _sequence_parallel_rules(values)


def _is_reference_transformer(factory: object) -> bool:
    from speedtronic.models.transformer import ReferenceTransformer

    return isinstance(factory, type) and issubclass(factory, ReferenceTransformer)


def _describe_under(error: ValidationError, prefix: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    """``_describe`` for an error found in a value that lives at ``prefix``."""
    error.path.extendleft(reversed(prefix))
    return _describe(error)


def _reference_transformer_rules(values: _Values) -> Iterator[str]:
    n_head = values.positive_int("model", "n_head")
    if n_head is None:
        return
    explicit_kv = values.get("model", "n_kv_head") is not None
    n_kv_head = values.positive_int("model", "n_kv_head") if explicit_kv else n_head
    if n_kv_head is not None and n_head % n_kv_head:
        yield f"model.n_head: {n_head} is not divisible by model.n_kv_head ({n_kv_head})"
    d_model = values.positive_int("model", "d_model")
    if d_model is not None and d_model % n_head:
        yield f"model.d_model: {d_model} is not divisible by model.n_head ({n_head})"


def _sequence_parallel_rules(values: _Values) -> Iterator[str]:
    """Under tensor parallelism the reference transformer's plan splits each sequence
    evenly over the tensor ranks between sub-layers (``SequenceParallel``): the sequence
    length (``data.block_size``, by default ``model.max_seq_len``) must be a multiple of
    the tensor degree. (A tensor degree without ``strategy: fsdp`` is refused by
    ``_parallel_rules``.)"""
    tensor = values.positive_int("parallel", "tensor")
    if tensor is None or tensor < 2 or values.text("parallel", "strategy") != "fsdp":
        return
    where = "data.block_size"
    block = values.positive_int("data", "block_size")
    if values.get("data", "block_size") is None:
        where = "the sequence length (data.block_size, by default model.max_seq_len)"
        block = values.positive_int("model", "max_seq_len")
    if block is not None and block % tensor:
        yield (
            f"parallel.tensor: {tensor} does not divide {where} ({block}): the reference "
            "transformer's sequence parallelism splits each sequence evenly over the tensor "
            f"ranks; use a sequence length that is a multiple of {tensor}"
        )


def _optimizer_rules(values: _Values) -> Iterator[str]:
    name = values.text("optimizer", "name")
    if values.flag("optimizer", "muon_plus") and name is not None and name != "muon":
        yield f"optimizer.muon_plus: requires optimizer.name 'muon' (got {name!r})"
    routing = values.get("optimizer", "routing")
    for index, rule in enumerate(routing if isinstance(routing, list) else []):
        if not isinstance(rule, Mapping) or rule.get("to") != "muon":
            continue
        ndim = rule.get("ndim")
        if isinstance(ndim, int) and not isinstance(ndim, bool) and ndim != 2:
            yield (
                f"optimizer.routing[{index}].ndim: Muon updates matrices only, "
                f"a rule sending ndim {ndim} to 'muon' can never apply"
            )


def _parallel_rules(values: _Values) -> Iterator[str]:
    """FSDP shards every parameter across the ranks; Muon's Newton-Schulz step needs each
    whole matrix, which this version does not gather (docs/scale-out.md)."""
    tensor = values.get("parallel", "tensor")
    if values.text("parallel", "strategy") != "fsdp":
        if isinstance(tensor, int) and tensor > 1:
            yield (
                f"parallel.tensor: {tensor} needs parallel.strategy 'fsdp' (tensor parallelism "
                "composes with FSDP2 over a data x tensor device mesh); set strategy: fsdp"
            )
        return
    if values.text("optimizer", "name") == "muon":
        yield (
            "parallel.strategy: 'fsdp' cannot be combined with optimizer.name 'muon': Muon's "
            "Newton-Schulz step needs each whole weight matrix and FSDP holds only a shard "
            "of it on each rank; use optimizer.name 'adamw' or parallel.strategy 'ddp'"
        )


def _data_rules(values: _Values) -> Iterator[str]:
    for section in ("data", "eval"):
        dataset = values.text(section, "dataset")
        if dataset is not None and dataset.lower().endswith(PICKLE_SUFFIXES):
            yield (
                f"{section}.dataset: {dataset!r} looks like a pickled dataset file; name a "
                "registered dataset instead (pickle files are never loaded)"
            )
    if values.text("eval", "text_path") is not None and values.text("eval", "dataset"):
        yield "eval.dataset: give eval.text_path or eval.dataset, not both"
    yield from _token_source_rules(values)
    data_vocab = values.positive_int("data", "vocab_size")
    model_vocab = values.positive_int("model", "vocab_size")
    if data_vocab is not None and model_vocab is not None and data_vocab > model_vocab:
        yield (
            f"data.vocab_size: {data_vocab} is larger than model.vocab_size ({model_vocab}); "
            "the model could not embed every token id"
        )


_SOURCE_KEYS = ("tokens", "mixture", "text_path", "dataset")


def _token_source_rules(values: _Values) -> Iterator[str]:
    """``data.tokens`` and ``data.mixture`` exclude the other sources; ``data.tokenizer``
    needs something to tokenize or check; a mixture is always shuffled."""
    given = [
        key
        for key in _SOURCE_KEYS
        if (values.get("data", key) if key == "mixture" else values.text("data", key))
    ]
    if {"tokens", "mixture"} & set(given) and len(given) > 1:
        named = " and ".join(f"data.{key}" for key in given)
        yield f"data.{given[1]}: give one training source, not {named}"
    text_sources = ("text_path", "tokens", "mixture")
    if values.text("data", "tokenizer") is not None and not (
        {*text_sources} & set(given) or values.text("eval", "text_path")
    ):
        yield (
            "data.tokenizer: nothing to tokenize or check (it applies to data.text_path, "
            "eval.text_path, data.tokens and data.mixture)"
        )
    if "mixture" in given and values.get("data", "shuffle") is False:
        yield "data.shuffle: false does not apply to data.mixture (a mixture is always shuffled)"


_EVAL_METRIC_PREFIX = "eval/"


def _eval_monitor_rules(values: _Values) -> Iterator[str]:
    """A ``monitor`` option (of any plugin section or ``callbacks:`` entry) that names an
    evaluation metric needs evaluation on (``eval.every_steps``): it could never appear."""
    if values.positive_int("eval", "every_steps") is not None:
        return
    places: list[tuple[str, object]] = []
    for key in plugin_root_keys():
        section = values.get_root(key)
        if isinstance(section, Mapping):
            places.append((key, section.get("monitor")))
    for index, entry in values.callback_entries():
        places.append((f"callbacks[{index}]", entry.get("monitor")))
    for where, monitor in places:
        if isinstance(monitor, str) and monitor.startswith(_EVAL_METRIC_PREFIX):
            yield (
                f"{where}.monitor: {monitor!r} is an evaluation metric, but evaluation is off "
                "(set eval.every_steps)"
            )


def _plugin_rules(values: _Values) -> Iterator[str]:
    """Each installed plugin's rules for its sections, then each ``callbacks:`` entry's
    rules, from the plugin it names."""
    for spec in plugins.configurable_specs():
        yield from spec.sections.errors(values.plugin_sections(spec))
    for index, entry in values.callback_entries():
        name = entry.get("name")
        if not isinstance(name, str) or name not in plugins.callback_registry:
            continue
        try:
            spec = plugins.plugin_spec(name)
        except plugins.PluginError:
            continue  # reported with the plugin names
        options = {key: value for key, value in entry.items() if key != "name"}
        yield from spec.options_errors(f"callbacks[{index}]", options, values.plugin_sections(spec))
