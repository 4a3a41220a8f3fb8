"""Text generation from a language model: ``generate_ids``.

The reference transformer decodes incrementally with a KV cache
(``ReferenceTransformer.forward_cached``): the prompt is run once, then each new token costs
one position's forward (``speedtronic.models.decoding``'s lean step for a plain model).
A ``transformers`` model (``HFCausalLM``) uses its own ``generate()``. Any other model
returning ``{"logits"}`` recomputes the whole prefix for every token, as does the
reference transformer with ``use_cache=False`` (the comparison the tests and
``benchmarks/generate.py`` make).

Sampling: ``temperature`` 0 is greedy (argmax); otherwise the logits are divided by it,
cut to the ``top_k`` most likely tokens when set, and sampled with a generator seeded by
``seed`` -- the same seed, model and prompt give the same tokens, and the global random
state is not touched. Prompt plus new tokens must fit the model's context; a prompt that
does not is a ``GenerationError`` (the CLI names ``--prompt``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from speedtronic.models.decoding import lean_decoder
from speedtronic.models.hf import HFCausalLM
from speedtronic.models.transformer import ReferenceTransformer

__all__ = [
    "GenerationError",
    "Sampling",
    "context_length",
    "generate_ids",
]


class GenerationError(ValueError):
    """Generation cannot run as asked: a prompt or length that does not fit the model."""


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen (module docstring)."""

    max_new_tokens: int = 100
    temperature: float = 1.0
    top_k: int | None = None
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    """Token ids that end the generation (after being emitted), e.g. end-of-document."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise GenerationError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise GenerationError(f"top_k must be positive, got {self.top_k}")


def context_length(model: nn.Module, default: int | None = None) -> int | None:
    """The number of positions ``model`` attends over (None when it does not say)."""
    if isinstance(model, ReferenceTransformer):
        return model.config.block_size
    if isinstance(model, HFCausalLM):
        config = getattr(model.hf, "config", None)
        for name in ("max_position_embeddings", "n_positions"):
            value = getattr(config, name, None)
            if isinstance(value, int):
                return value
    return default


def _check_length(prompt: int, new: int, context: int | None) -> None:
    if prompt < 1:
        raise GenerationError("the prompt is empty: it must hold at least one token")
    if context is None:
        return
    if prompt > context:
        raise GenerationError(
            f"the prompt is {prompt} tokens, longer than the model's context of {context}"
        )
    if prompt + new > context:
        raise GenerationError(
            f"the prompt ({prompt} tokens) and max_new_tokens ({new}) exceed the model's "
            f"context of {context}: ask for at most {context - prompt} new tokens"
        )


def _device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


class _Chooser:
    """Picks the next token from last-position logits (module docstring)."""

    def __init__(self, sampling: Sampling, device: torch.device) -> None:
        self.sampling = sampling
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(sampling.seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """``(B, vocab)`` logits -> ``(B, 1)`` token ids."""
        sampling = self.sampling
        logits = logits.float()
        if sampling.temperature == 0:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits / sampling.temperature
        if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
            kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator)


def _logits_of(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def call(ids: torch.Tensor) -> torch.Tensor:
        output = model(ids)
        found = output["logits"] if isinstance(output, dict) else output.logits
        return cast(torch.Tensor, found)

    return call


def _decode_loop(
    step: Callable[[torch.Tensor, bool], torch.Tensor],
    prompt: torch.Tensor,
    sampling: Sampling,
) -> list[int]:
    """``step(ids, first)`` returns the next-token logits ``(B, vocab)``; ``ids`` is the
    whole sequence so far (``step`` decides how much of it to run)."""
    choose = _Chooser(sampling, prompt.device)
    ids = prompt
    new: list[int] = []
    for index in range(sampling.max_new_tokens):
        token = choose(step(ids, index == 0))
        ids = torch.cat([ids, token], dim=1)
        new.append(int(token[0, 0]))
        if new[-1] in sampling.stop_ids:
            break
    return new


_STOP_CHECK_EVERY = 32
"""Tokens between looks for a stop id in the cached loop: one host read per 32 tokens,
not per token (the tokens past a stop id are computed and dropped)."""


def _until_stop(tokens: list[int], stop_ids: tuple[int, ...]) -> list[int]:
    """``tokens`` up to and including the first stop id."""
    for index, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: index + 1]
    return tokens


def _reference_cached(
    model: ReferenceTransformer, prompt: torch.Tensor, sampling: Sampling
) -> list[int]:
    """The prompt through ``forward_cached`` once, then one-token steps (the lean decoder
    of ``speedtronic.models.decoding`` when the model is plain); the tokens stay on the
    device, written into a preallocated row, and are read back at the end (and once per
    ``_STOP_CHECK_EVERY`` tokens when there are stop ids)."""
    new = sampling.max_new_tokens
    cache = model.new_kv_cache(1, prompt.shape[1] + new)
    choose = _Chooser(sampling, prompt.device)
    token = choose(model.forward_cached(prompt, cache)[:, -1])
    decoder = lean_decoder(model, cache)
    step = (
        decoder.step if decoder is not None else lambda ids: model.forward_cached(ids, cache)[:, -1]
    )
    tokens = torch.empty((1, new), dtype=torch.long, device=prompt.device)
    tokens[:, :1] = token
    stops = torch.tensor(sampling.stop_ids, dtype=torch.long, device=prompt.device)
    filled = 1
    while filled < new:
        if stops.numel() and filled % _STOP_CHECK_EVERY == 0:
            if bool(torch.isin(tokens[:, :filled], stops).any()):
                break
        token = choose(step(token))
        tokens[:, filled : filled + 1] = token
        filled += 1
    return _until_stop(tokens[0, :filled].tolist(), sampling.stop_ids)


def _recomputed(model: nn.Module, prompt: torch.Tensor, sampling: Sampling) -> list[int]:
    logits = _logits_of(model)
    return _decode_loop(lambda ids, first: logits(ids)[:, -1], prompt, sampling)


def _hf_generate(
    model: HFCausalLM, prompt: torch.Tensor, sampling: Sampling, use_cache: bool
) -> list[int]:
    sample = sampling.temperature > 0
    options: dict[str, object] = {
        "max_new_tokens": sampling.max_new_tokens,
        "do_sample": sample,
        "use_cache": use_cache,
        "attention_mask": torch.ones_like(prompt),
        # No pad token in speedtronic's data: any id serves, one sequence is never padded.
        "pad_token_id": sampling.stop_ids[0] if sampling.stop_ids else 0,
    }
    if sample:
        options.update(temperature=sampling.temperature, top_k=sampling.top_k or 0)
    if sampling.stop_ids:
        options["eos_token_id"] = list(sampling.stop_ids)
    generate = cast(Callable[..., torch.Tensor], model.hf.generate)
    devices = [prompt.device] if prompt.device.type == "cuda" else []
    # transformers samples from the global generator: seed a forked copy of it.
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(sampling.seed)
        output = generate(prompt, **options)
    return [int(token) for token in output[0, prompt.shape[1] :]]


def generate_ids(
    model: nn.Module,
    prompt_ids: list[int],
    sampling: Sampling,
    *,
    use_cache: bool = True,
    context: int | None = None,
) -> list[int]:
    """The ids ``model`` generates after ``prompt_ids`` (module docstring). ``context`` is
    the model's length when the model itself does not say (``context_length``).
    ``GenerationError`` when the prompt and the new tokens do not fit it."""
    _check_length(len(prompt_ids), sampling.max_new_tokens, context_length(model, context))
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            prompt = torch.tensor([prompt_ids], dtype=torch.long, device=_device(model))
            if isinstance(model, HFCausalLM):
                return _hf_generate(model, prompt, sampling, use_cache)
            if use_cache and isinstance(model, ReferenceTransformer):
                return _reference_cached(model, prompt, sampling)
            return _recomputed(model, prompt, sampling)
    finally:
        model.train(was_training)
