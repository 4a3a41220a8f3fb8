"""The system sections: ``precision``, ``logging``, ``distributed``, ``parallel``,
``shape_validation``, and a ``callbacks:`` entry."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal, cast

from speedtronic.config.declare import Opt
from speedtronic.config.section_base import (
    STEPS_MAX,
    JSONValue,
    PluginKeysAsAttributes,
    Section,
    redact_secrets,
)
from speedtronic.errors import ConfigError


@dataclass
class PrecisionConfig(Section):
    """``precision:`` -- ``auto`` or a forced bf16/fp16/fp32 mode."""

    section_name: ClassVar[str] = "precision"
    bare_value: ClassVar[str | None] = "mode"
    section_doc: ClassVar[str] = (
        "Numeric precision. A bare string (precision: bf16) is a shorthand for {mode: bf16}."
    )

    mode: Annotated[
        Literal["auto", "bf16", "fp16", "fp32"],
        Opt(
            "`auto`: bf16 on CUDA that supports it, else fp16 (with a grad scaler); fp32 on "
            "CPU and MPS. Forced `bf16` falls back to fp32 on CUDA without bf16 and on MPS; "
            "forced `fp16` is fp32 off CUDA",
            fold="lower",
        ),
    ] = "auto"
    dtype: Annotated[
        Literal["bf16", "fp16", "fp32"] | None,
        Opt(
            "with `mode: auto`, the mode to request instead (the same fallbacks apply)",
            fold="lower",
        ),
    ] = None


@dataclass(eq=False)  # equality includes the plugin keys (the mixin's)
class LoggingConfig(PluginKeysAsAttributes, Section):
    """``logging:`` -- log level and file, and the metric cadence. Sink plugins add their
    2.0 switches (``console``, ``jsonl``, ``json_file``), readable as attributes."""

    section_name: ClassVar[str] = "logging"
    section_doc: ClassVar[str] = (
        "Logging and metric cadence. Plugins add their own keys (the 2.0 default-sink "
        "switches come from the sink plugins)."
    )

    level: Annotated[
        str,
        Opt(
            "any case; the level of the `speedtronic` Python loggers (checkpoint, resume, "
            "shape and plugin messages)",
            extra={"enum": ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]},
            fold="upper",
            type_text="`DEBUG` | `INFO` | `WARNING` | `ERROR` | `CRITICAL`",
        ),
    ] = "INFO"
    file: Annotated[
        str | None,
        Opt(
            "the text log file of the default console sink: its lines go there (relative to "
            "`run.output_dir`) instead of the terminal",
            min_length=1,
        ),
    ] = None
    every_steps: Annotated[
        int,
        Opt(
            "metric cadence: a record is due every N global steps (and at the last step)",
            minimum=1,
            maximum=STEPS_MAX,
        ),
    ] = 1


@dataclass(eq=False)  # equality includes the plugin keys (the mixin's)
class DistributedConfig(PluginKeysAsAttributes, Section):
    """``distributed:`` -- settings of torch.distributed runs (``timeout_s``, the per-step
    collective timeout). Plugins add their 2.0 keys, readable as attributes."""

    section_name: ClassVar[str] = "distributed"
    section_doc: ClassVar[str] = (
        "Settings of torch.distributed runs (torchrun). Plugins add their own keys to this section."
    )

    timeout_s: Annotated[
        float,
        Opt(
            "`torch.distributed` collective timeout, seconds",
            exclusive_minimum=0,
            maximum=30 * 86400,
        ),
    ] = 1800.0


@dataclass
class ParallelConfig(Section):
    """``parallel:`` -- how a multi-rank run splits the model: ``ddp`` (every rank holds
    the whole model and optimizer state) or ``fsdp`` (FSDP2: parameters, gradients and
    optimizer state sharded across the ranks; see docs/scale-out.md)."""

    section_name: ClassVar[str] = "parallel"
    section_doc: ClassVar[str] = (
        "How a multi-rank (torchrun) run splits the model across ranks: ddp replicates it, "
        "fsdp shards parameters, gradients and optimizer state (FSDP2)."
    )

    strategy: Annotated[
        Literal["ddp", "fsdp"],
        Opt(
            "any case. `ddp`: every rank holds the whole model and optimizer state "
            "(`DistributedDataParallel`). `fsdp`: FSDP2 (`fully_shard`) shards parameters, "
            "gradients and optimizer state across the ranks, and checkpoints are sharded (DCP) "
            "directories that resume on another number of ranks",
            fold="lower",
        ),
    ] = "ddp"
    reshard_after_forward: Annotated[
        bool,
        Opt(
            "`fsdp`: free each block's gathered parameters after its forward pass (less "
            "memory; backward gathers them again)"
        ),
    ] = True
    tensor: Annotated[
        int,
        Opt(
            "`fsdp`: tensor-parallel degree T: each layer is split over T ranks (a 2-D "
            "`data x tensor` device mesh; FSDP shards over the data ranks). Must divide the "
            "world size, the attention and key/value heads and the MLP hidden size; the model "
            "family needs a plan (docs/scale-out.md). 1: no tensor parallelism",
            minimum=1,
            maximum=4096,
        ),
    ] = 1


@dataclass
class ShapeValidationConfig(Section):
    """``shape_validation:`` -- startup warnings about unaligned shapes (never errors)."""

    section_name: ClassVar[str] = "shape_validation"
    section_doc: ClassVar[str] = (
        "Startup warnings about tensor-core-unfriendly shapes (never errors)."
    )

    enabled: Annotated[bool, Opt("check shapes at startup")] = True
    alignment: Annotated[
        int | Literal["auto", "none"],
        Opt(
            "`auto`: 8 on CUDA with bf16/fp16, no checks elsewhere; `none`: no checks; `null` "
            "means `auto`",
            schema={
                "type": ["integer", "string"],
                "minimum": 1,
                "maximum": 4096,
                "if": {"type": "string"},
                "then": {"enum": ["auto", "none"]},
            },
            fold="lower",
            type_text="int ≥ 1, `auto` or `none`",
        ),
    ] = "auto"
    check_batch: Annotated[bool, Opt("`data.micro_batch_size`")] = True
    check_sequence: Annotated[
        bool, Opt("`data.block_size` and `micro_batch_size * block_size`")
    ] = True
    check_model: Annotated[bool, Opt("model GEMM dimensions")] = True
    check_vocab: Annotated[bool, Opt("`model.vocab_size`")] = False
    warn_on_cpu: Annotated[bool, Opt("also warn on CPU/MPS when an explicit alignment is set")] = (
        False
    )

    def __post_build__(self) -> None:
        if self.alignment is None:  # the original treated null as auto
            self.alignment = "auto"


@dataclass
class CallbackSpec:
    """One ``callbacks:`` entry: the plugin name and its (validated) options."""

    name: str
    options: dict[str, JSONValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if "name" in self.options:
            raise ConfigError(
                f"callbacks: option 'name' of {self.name!r} clashes with the plugin name"
            )

    def to_dict(self) -> dict[str, JSONValue]:
        """The entry as written in config: ``{name: ..., **options}``."""
        return {"name": self.name, **self.options}

    @classmethod
    def from_dict(cls, entry: Mapping[str, object]) -> CallbackSpec:
        """An entry ``{name: ..., **options}`` (already validated)."""
        options = {key: value for key, value in entry.items() if key != "name"}
        return cls(name=str(entry["name"]), options=cast("dict[str, JSONValue]", options))

    def __repr__(self) -> str:
        return f"CallbackSpec(name={self.name!r}, options={redact_secrets(self.options)!r})"
