"""EleutherAI's lm-evaluation-harness on a speedtronic model: ``SpeedtronicLM``.

An ``lm_eval.api.model.LM`` over any model speedtronic builds (the reference transformer, an
``hf_causal_lm``, a LoRA-adapted one) and the run's tokenizer:

* ``loglikelihood`` scores ``(context, continuation)`` requests in batches
  (``speedtronic.evaluation.likelihood``); an empty context is preceded by the run's
  end-of-document token, as the harness's own models do;
* ``loglikelihood_rolling`` sums a text's token log-probabilities over the harness's
  rolling windows of the model's context;
* ``generate_until`` generates with ``speedtronic.models.generation`` (greedy unless the
  task asks to sample) and cuts at the first ``until`` string.

``SpeedtronicLM.from_run(config, checkpoint=None)`` loads a run's checkpoint;
``lm_eval.simple_evaluate(model=SpeedtronicLM.from_run("run.yaml"), tasks=[...])`` then runs
any task, local task YAMLs included (``TaskManager(include_path=...)``). The class is
registered with the harness as ``speedtronic`` (``model_args``: ``config=run.yaml,
checkpoint=...,batch_size=...``) once this module is imported. ``lm_eval`` is not a
dependency of speedtronic: install it to use this module (``pip install lm-eval``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

import torch
from lm_eval import utils as lm_utils  # typed by typings/lm_eval
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from torch import nn

from speedtronic.evaluation.likelihood import Continuation, score_continuations
from speedtronic.evaluation.text import RunText, run_text
from speedtronic.models.generation import Sampling, context_length, generate_ids
from speedtronic.runtime import as_config, checkpoint_model

__all__ = ["SpeedtronicLM"]

_DEFAULT_MAX_GEN_TOKS = 256


class Request(Protocol):
    """The part of ``lm_eval.api.instance.Instance`` read here."""

    args: tuple[object, ...]


def _device(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


@register_model("speedtronic")
class SpeedtronicLM(LM):
    """A speedtronic model and the run's tokenizer as an lm-evaluation-harness ``LM``."""

    def __init__(
        self,
        model: nn.Module,
        text: RunText,
        *,
        batch_size: int = 16,
        context: int | None = None,
        max_gen_toks: int = _DEFAULT_MAX_GEN_TOKS,
    ) -> None:
        super().__init__()
        self.model = model
        self.text = text
        self.batch_size = int(batch_size)
        self.context = context_length(model, context)
        self.max_gen_toks = int(max_gen_toks)
        if not text.stop_ids:
            raise ValueError("the run's tokenizer names no end-of-document token")
        self.eot = text.stop_ids[0]

    @classmethod
    def from_run(
        cls,
        config: str,
        checkpoint: str | None = None,
        *,
        batch_size: int = 16,
        device: str | None = None,
    ) -> SpeedtronicLM:
        """The checkpoint of a run (the latest, or ``checkpoint``) and its tokenizer."""
        cfg = as_config(config)
        _, model = checkpoint_model(cfg, checkpoint=checkpoint, device=device)
        text = run_text(cfg.data.to_dict())
        return cls(model, text, batch_size=batch_size, context=cfg.model.max_seq_len)

    @classmethod
    def create_from_arg_string(
        cls, arg_string: str, additional_config: dict[str, object] | None = None
    ) -> SpeedtronicLM:
        """``model_args`` of the harness: ``config=run.yaml[,checkpoint=...][,batch_size=N]``."""
        args = lm_utils.simple_parse_args_string(arg_string)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        batch = args.get("batch_size", extra.get("batch_size", 16))
        checkpoint = args.get("checkpoint")
        device = extra.get("device")
        return cls.from_run(
            str(args["config"]),
            None if checkpoint is None else str(checkpoint),
            batch_size=int(str(batch)),
            device=None if device is None else str(device),
        )

    def _scores(self, items: Sequence[Continuation]) -> list[tuple[float, bool]]:
        scored, _ = score_continuations(
            self.model,
            items,
            device=_device(self.model),
            batch_size=self.batch_size,
            context=self.context,
        )
        return [(score.logprob, score.greedy) for score in scored]

    def loglikelihood(self, requests: Sequence[Request]) -> list[tuple[float, bool]]:
        items = []
        for index, request in enumerate(requests):
            context, continuation = (str(part) for part in request.args[:2])
            prompt = tuple(self.text.encode(context)) or (self.eot,)
            tokens = tuple(self.text.encode(continuation))
            items.append(Continuation(prompt, tokens, f"loglikelihood request {index}"))
        return self._scores(items)

    def loglikelihood_rolling(self, requests: Sequence[Request]) -> list[float]:
        limit = self.context or len(self.text.encode(str(requests[0].args[0]))) + 1
        results = []
        for index, request in enumerate(requests):
            tokens = self.text.encode(str(request.args[0]))
            windows = map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.eot, max_seq_len=limit, context_len=1
                ),
            )
            items = [
                Continuation(tuple(context), tuple(target), f"rolling request {index}")
                for context, target in windows
            ]
            results.append(sum(logprob for logprob, _ in self._scores(items)))
        return results

    def generate_until(self, requests: Sequence[Request]) -> list[str]:
        outputs = []
        for request in requests:
            context, options = str(request.args[0]), request.args[1]
            settings = dict(cast(dict[str, object], options)) if isinstance(options, dict) else {}
            until = settings.get("until") or []
            stops = (
                [until] if isinstance(until, str) else [str(s) for s in cast(list[object], until)]
            )
            new = int(str(settings.get("max_gen_toks", self.max_gen_toks)))
            sample = bool(settings.get("do_sample", False))
            temperature = float(str(settings.get("temperature", 1.0))) if sample else 0.0
            prompt = self.text.encode(context) or [self.eot]
            if self.context is not None:
                new = max(1, min(new, self.context - 1))
                prompt = prompt[-(self.context - new) :]
            sampling = Sampling(
                max_new_tokens=new, temperature=temperature, stop_ids=self.text.stop_ids
            )
            written = self.text.decode(generate_ids(self.model, prompt, sampling))
            for stop in stops:
                if stop and stop in written:
                    written = written[: written.index(stop)]
            outputs.append(written)
        return outputs
