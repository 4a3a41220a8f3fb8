"""The ``run:`` section: the run's name, directory, steps and seed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

from speedtronic.config.declare import Opt
from speedtronic.config.section_base import SEED_MAX, STEPS_MAX, Section


@dataclass
class RunConfig(Section):
    """``run:`` -- identity, seed, device and the training target."""

    section_name: ClassVar[str] = "run"
    section_doc: ClassVar[str] = "Run identity, seed, device and training target."

    name: Annotated[str, Opt("non-empty; a label, not a path", min_length=1, shorthand=True)] = (
        "speedtronic-run"
    )
    seed: Annotated[
        int,
        Opt(
            "seeds Python, NumPy and torch; the default of `data.seed`",
            minimum=0,
            maximum=SEED_MAX,
            type_text="int 0 … 2³²−1",
            shorthand=True,
        ),
    ] = 1234
    device: Annotated[
        str,
        Opt(
            "`auto` = CUDA, then MPS, then CPU; or a torch device (`cpu`, `cuda`, `cuda:1`, "
            "`mps`); an explicit device that is not available is an error when the run is built",
            min_length=1,
            shorthand=True,
        ),
    ] = "auto"
    max_steps: Annotated[
        int,
        Opt(
            "absolute target of global optimizer steps (a resumed run continues up to it); "
            "`data.max_steps` wins when set",
            minimum=1,
            maximum=STEPS_MAX,
            shorthand=True,
        ),
    ] = 1000
    max_epochs: Annotated[
        int | None,
        Opt(
            "also stop after this many passes over the data, whichever of "
            "`max_steps`/`max_epochs` comes first (see [training "
            "target](#training-target---max-steps-and-the-lr-schedule))",
            minimum=1,
            maximum=STEPS_MAX,
        ),
    ] = None
    output_dir: Annotated[
        str,
        Opt(
            "the run directory: `config.yaml`, `metrics.jsonl`, `checkpoints/`; the base of "
            "every relative path a plugin writes",
            min_length=1,
            shorthand=True,
        ),
    ] = "runs"
    log_every: Annotated[
        int | None,
        Opt(
            "legacy spelling of `logging.every_steps`, copied there; giving both with "
            "different values is an error",
            minimum=1,
            maximum=STEPS_MAX,
            shorthand=True,
            fills="logging.every_steps",
        ),
    ] = None
    threads: Annotated[
        int | Literal["auto"],
        Opt(
            "CPU threads torch uses (`torch.set_num_threads`); `auto` is 1 for a model under "
            "20M parameters trained on the CPU, torch's default otherwise, on CUDA/MPS, and "
            "whenever `OMP_NUM_THREADS` is set (see "
            "[performance](performance.md#cpu-threads--runthreads)); the start line says what "
            "was chosen, e.g. `threads 1 (auto)`",
            schema={
                "anyOf": [{"const": "auto"}, {"type": "integer", "minimum": 1, "maximum": 4096}]
            },
            type_text="`auto` or int ≥ 1",
        ),
    ] = "auto"
    stop_grace_s: Annotated[
        float | None,
        Opt(
            "seconds: how long a requested stop (SIGTERM, Ctrl-C, a callback's `request_stop`) "
            "waits for a batch the data loader does not deliver; then the fit gives up on it "
            "and exits 1, keeping the last completed step's checkpoint (see "
            "[checkpointing](checkpointing.md))",
            exclusive_minimum=0,
            maximum=86400,
            default_text="`null` (10 s, `Trainer.stop_grace_s`)",
        ),
    ] = None
