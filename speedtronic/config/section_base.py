"""The pieces every ``run.yaml`` section is made of: the section base class, the
plugin-key mixin, secret redaction and the JSON value type."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, TypeAlias, TypeVar, cast

from typing_extensions import Self

from speedtronic.config import declare
from speedtronic.config.loading import (
    REDACTED,
    fold_value,
    normalise,
)
from speedtronic.config.schema import plugin_section_keys, schema_defaults
from speedtronic.config.validation import config_errors
from speedtronic.errors import ConfigError

JSONValue: TypeAlias = None | bool | int | float | str | list["JSONValue"] | dict[str, "JSONValue"]
"""A value that JSON (and YAML) can represent."""

T = TypeVar("T")

SECRET_KEYS = frozenset({"token", "secret", "password", "hmac_key", "api_key"})
"""Keys whose values are secrets wherever they appear (case-insensitive)."""

STEPS_MAX = 10**12
"""The bound of every step count (``run.max_steps``, ``eval.every_steps``, ...): 10^12 steps."""
SEED_MAX = 2**32 - 1
"""The bound of a seed: what NumPy accepts."""


def redact_secrets(value: JSONValue) -> JSONValue:
    """A copy of ``value`` with every non-empty secret (``SECRET_KEYS``) replaced by
    ``"<redacted>"``, at any depth (distributed.token, callback options, ...)."""
    if isinstance(value, dict):
        return {
            key: (
                REDACTED
                if key.lower() in SECRET_KEYS and item not in (None, "")
                else redact_secrets(item)
            )
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [redact_secrets(item) for item in value]
    return value


def jsonable(value: object) -> JSONValue:
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict) and not isinstance(value, type):
        return jsonable(to_dict())
    if isinstance(value, Mapping):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if isinstance(value, os.PathLike):
        return str(os.fspath(value))
    # Scalars pass through; anything else is left for validation to report by path.
    return cast(JSONValue, value)


# -- sections -----------------------------------------------------------------------------


@dataclass
class Section:
    """Shared behaviour of the section dataclasses: extensions, construction from Python."""

    section_name: ClassVar[str] = ""
    section_doc: ClassVar[str] = ""
    """The section's description in the run schema."""
    bare_value: ClassVar[str | None] = None
    """The key a section written as a bare value means (``optimizer: muon`` is
    ``{name: muon}``)."""

    @property
    def extensions(self) -> dict[str, JSONValue]:
        """Keys that installed plugins add to this section (``PluginSpec.sections``)."""
        extensions = self.__dict__.get("_extensions")
        if extensions is None:
            extensions = {
                key: cast(JSONValue, schema_defaults(self.section_name).get(key))
                for key in plugin_section_keys(self.section_name)
            }
            self.__dict__["_extensions"] = extensions
        return cast("dict[str, JSONValue]", extensions)

    def __post_init__(self) -> None:
        """Built from Python: lossless coercion (``lr=1`` -> ``1.0``), case folding, the
        derived defaults, then this section's one validation pass."""
        for item in declare.declared(type(self)):
            value = declare.coerce(item.hint, getattr(self, item.name))
            if item.opt.fold is not None and isinstance(value, str):
                value = fold_value(item.opt.fold, value)
            object.__setattr__(self, item.name, value)
        self.__post_build__()
        errors = config_errors({self.section_name: self.to_dict()})
        if errors:
            raise ConfigError(errors)

    def __post_build__(self) -> None:
        """Derive defaults that depend on other keys of the section (also run by
        ``declare.build``, which builds a section from validated data)."""

    def to_dict(self) -> dict[str, JSONValue]:
        """The section as JSON-compatible data, keys in declaration order (the fields, then
        the keys plugins add)."""
        values = {
            item.name: jsonable(getattr(self, item.name)) for item in dataclasses.fields(self)
        }
        values.update((key, jsonable(value)) for key, value in self.extensions.items())
        return values

    @classmethod
    def from_dict(cls, values: Mapping[str, object] | None = None) -> Self:
        """Validate ``values`` as this section (shorthands and case folding included)."""
        data, errors = normalise({cls.section_name: {} if values is None else values})
        errors.extend(config_errors(data))
        if errors:
            raise ConfigError(errors)
        return cls._from_valid(as_mapping(data.get(cls.section_name)))

    @classmethod
    def _from_valid(cls, values: Mapping[str, object]) -> Self:
        """The section from validated values (its fields, then the keys plugins add)."""
        names = field_names(cls)
        section = declare.build(cls, {k: v for k, v in values.items() if k in names})
        section.extensions.update(
            (key, cast(JSONValue, value)) for key, value in values.items() if key not in names
        )
        return section

    def keys_of(self, declaring: type[T]) -> T:
        """This section's keys that the dataclass ``declaring`` declares, typed: the keys a
        plugin adds (``config.logging.keys_of(JsonlLoggingKeys).json_file``), built from the
        validated values without checking them again."""
        values = self.to_dict()
        names = {item.name for item in declare.declared(declaring)}
        return declare.build(declaring, {key: values[key] for key in names if key in values})

    def _stated(self) -> dict[str, JSONValue]:
        """What this section states: ``to_dict()`` without the fields that hold their
        declared default (a dataclass cannot tell a default from one given explicitly)."""
        values = self.to_dict()
        for item in declare.declared(type(self)):
            if item.has_default and values.get(item.name) == declare.to_json(item.default()):
                del values[item.name]
        return values


class PluginKeysAsAttributes:
    """Read (and set) the keys plugins add to a section as attributes: ``logging.console``.
    Typed as plain JSON values; a plugin's own options are the typed way in."""

    extensions: dict[str, JSONValue]
    if TYPE_CHECKING:  # provided by Section, which comes after this mixin

        def to_dict(self) -> dict[str, JSONValue]: ...

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, PluginKeysAsAttributes)
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable, like the other sections

    def __getattr__(self, name: str) -> JSONValue:
        extensions = self.__dict__.get("_extensions")
        if extensions is None and not name.startswith("_"):
            extensions = self.extensions
        if isinstance(extensions, dict) and name in extensions:
            return cast(JSONValue, extensions[name])
        raise AttributeError(f"{type(self).__name__} has no setting {name!r}")

    def __setattr__(self, name: str, value: object) -> None:
        if name in field_names(type(self)) or name.startswith("_"):
            object.__setattr__(self, name, value)
        elif name in self.extensions:
            self.extensions[name] = cast(JSONValue, value)
        else:
            raise AttributeError(f"{type(self).__name__} has no setting {name!r}")


def field_names(cls: type) -> frozenset[str]:
    return frozenset(item.name for item in dataclasses.fields(cls))


def as_mapping(value: object) -> Mapping[str, object]:
    return cast("Mapping[str, object]", value) if isinstance(value, Mapping) else {}


def redacted_repr(section: object) -> str:
    """A section's repr with its free-form mappings redacted: ``dataset_options`` may hold
    credentials, and are never printed."""
    values = ", ".join(
        f"{item.name}={redacted(getattr(section, item.name))!r}"
        for item in dataclasses.fields(cast("type", type(section)))
    )
    return f"{type(section).__name__}({values})"


def redacted(value: object) -> object:
    return redact_secrets(cast(JSONValue, value)) if isinstance(value, dict) else value
