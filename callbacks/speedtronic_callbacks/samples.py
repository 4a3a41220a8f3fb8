"""``text_samples``: what the model writes after fixed prompts, every N steps, in every sink.

A contributor of the ``metrics`` event: on its steps (every ``every_steps`` and the final
step) it generates a continuation of each prompt with the model as it is
(``speedtronic.models.generation.generate_ids``: the reference transformer's KV cache, a
``transformers`` model's ``generate()``), decoded with the run's tokenizer, and adds them
to the step's record as text: ``text_samples/0``, ``text_samples/1``, ... (the prompt
followed by the continuation). Every sink writes them as it writes text: the JSONL sink in
the record's line, TensorBoard as a text summary per key, the console on its line.

Off the hot path: it is called on its steps only (no hook on the others), on rank 0 only
(``rank_policy = "main"``), in ``inference_mode`` with the model's mode and every random
state restored, so a run with samples trains and resumes exactly like one without. Its
steps should be logging steps (a multiple of ``logging.every_steps``) for the sinks to
see them; another ``every_steps`` is a warning at setup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, ClassVar

from speedtronic.config import ConfigError
from speedtronic.config.declare import Opt, plugin
from speedtronic.engine.callback import Callback, RankPolicy
from speedtronic.engine.contexts import FitContext, MetricsContext
from speedtronic.engine.events import Event
from speedtronic.engine.filters import every, final_step
from speedtronic.evaluation.text import RunText, TextError, run_text
from speedtronic.models.generation import Sampling, generate_ids
from speedtronic.state.rng import capture_rng_state, restore_rng_state
from speedtronic.user_warnings import warn

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView
    from speedtronic.plugins import PluginContext

_SAMPLES_PREFIX = "text_samples/"
"""The record keys' prefix (``samples`` alone is the trainer's sample counter)."""


@dataclass(frozen=True)
class SamplesOptions:
    """The ``text_samples`` callback's options."""

    prompts: Annotated[
        list[str],
        Opt("the prompts to continue (the same ones every time)", extra={"minItems": 1}),
    ]
    every_steps: Annotated[
        int, Opt("generate every N global steps (and on the final step)", minimum=1)
    ] = 100
    max_new_tokens: Annotated[int, Opt("tokens per sample", minimum=1, maximum=65536)] = 64
    temperature: Annotated[
        float,
        Opt("0: greedy (comparable from step to step); else the sampling temperature", minimum=0),
    ] = 0.0
    top_k: Annotated[int | None, Opt("sample among the k most likely tokens", minimum=1)] = None
    seed: Annotated[int, Opt("the sampling seed (the same at every step)", minimum=0)] = 0


def _build(
    cls: type[SamplesCallback], options: SamplesOptions, context: PluginContext
) -> SamplesCallback:
    """From config: the run's tokenizer and context; a problem is a config error (exit 2)."""
    if context.config.parallel.strategy == "fsdp":  # rank 0 alone cannot run sharded layers
        raise ConfigError("text_samples: not available under parallel.strategy fsdp yet")
    try:
        return cls(
            text=run_text(context.config.data.to_dict()),
            context_length=context.config.model.max_seq_len,
            prompts=options.prompts,
            every_steps=options.every_steps,
            max_new_tokens=options.max_new_tokens,
            temperature=options.temperature,
            top_k=options.top_k,
            seed=options.seed,
        )
    except (TextError, ValueError) as exc:
        message = str(exc)
        raise ConfigError(
            message if message.startswith("text_samples") else f"text_samples: {message}"
        ) from None


@plugin("text_samples", options=SamplesOptions, build=_build)
class SamplesCallback(Callback):
    """Adds ``text_samples/<i>``: each prompt's continuation by the model (module docstring)."""

    is_observer: ClassVar[bool] = True  # a sample that fails must not stop training
    rank_policy: ClassVar[RankPolicy] = "main"  # the sinks run on rank 0

    def __init__(
        self,
        *,
        text: RunText,
        prompts: list[str],
        every_steps: int = SamplesOptions.every_steps,
        max_new_tokens: int = SamplesOptions.max_new_tokens,
        temperature: float = SamplesOptions.temperature,
        top_k: int | None = SamplesOptions.top_k,
        seed: int = SamplesOptions.seed,
        context_length: int | None = None,
    ) -> None:
        if not prompts:
            raise ValueError("text_samples: prompts must name at least one prompt")
        if every_steps < 1:
            raise ValueError(f"text_samples: every_steps must be positive, got {every_steps}")
        self.text = text
        self.prompts = list(prompts)
        self.every_steps = every_steps
        self.sampling = Sampling(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            seed=seed,
            stop_ids=text.stop_ids,
        )
        self.context_length = context_length
        for index, prompt in enumerate(self.prompts):
            length = len(text.encode(prompt)) + max_new_tokens
            if context_length is not None and length > context_length:
                raise ValueError(
                    f"text_samples: prompts[{index}] ({length - max_new_tokens} tokens) and "
                    f"max_new_tokens ({max_new_tokens}) exceed the model's context of "
                    f"{context_length}"
                )
        self.due_when = {Event.METRICS: every(every_steps) | final_step()}

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None:
        if self.every_steps % trainer.metrics_every:
            warn(
                f"text_samples: every_steps={self.every_steps} is not a multiple of the logging "
                f"cadence ({trainer.metrics_every} steps): only the samples of logging steps "
                "reach the sinks",
                UserWarning,
            )

    def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        for index, sample in enumerate(self.generate(trainer)):
            ctx.record.set(f"{_SAMPLES_PREFIX}{index}", sample)

    def generate(self, trainer: TrainerView) -> list[str]:
        """Each prompt followed by the model's continuation; the random state and the
        model's mode are left as they were."""
        rng = capture_rng_state()
        try:
            samples = []
            for prompt in self.prompts:
                ids = generate_ids(
                    trainer.model,
                    self.text.encode(prompt),
                    self.sampling,
                    context=self.context_length,
                )
                samples.append(prompt + self.text.decode(ids))
            return samples
        finally:
            restore_rng_state(rng)
