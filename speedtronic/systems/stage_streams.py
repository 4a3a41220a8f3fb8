"""Out-of-order backprop: run disjoint forward stages on separate CUDA streams.

Autograd runs each backward node on the stream its forward op used, so putting independent
forward *stages* on different streams lets their backward passes overlap. This is a
correctness-first seam with no promised speed-up: a model that is a single chain gains
little; models with parallel branches gain more. On anything but CUDA the scheduler exists
but is disabled (``enabled`` is false and ``reason`` says why), and ``begin`` / ``finish`` do
nothing, so the training path is exactly the sequential one.

Stages are the modules named by the model's ``ooo_stage_names`` (dotted names, disjoint),
or else every leaf module. Stage *i* runs on stream ``i mod n``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from speedtronic.systems.shapes import WarningLogger

__all__ = ["StageInfo", "StageStreamScheduler", "WarningLogger"]

_MAX_STREAMS = 8

_LOGGER = logging.getLogger("speedtronic.stage_streams")


@dataclass(frozen=True)
class StageInfo:
    """A stage: its dotted name, its module and the index of the stream it runs on."""

    name: str
    module: nn.Module = field(repr=False, compare=False)
    stream_index: int = 0


def _tensors(value: object) -> Iterator[torch.Tensor]:
    """Every tensor inside nested args/kwargs (lists, tuples, dicts)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _new_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]  # torch leaves Stream.__new__ unannotated


def _set_stream(stream: torch.cuda.Stream) -> None:
    torch.cuda.set_stream(stream)


def _declared_stages(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    names = getattr(model, "ooo_stage_names", None)
    if names is None:
        return None
    listed = [str(n) for n in names]
    if len(set(listed)) != len(listed):
        raise ValueError(f"ooo_stage_names has duplicates: {listed}")
    for a in listed:
        for b in listed:
            if a != b and b.startswith(a + "."):
                raise ValueError(f"ooo_stage_names are nested: {a!r} contains {b!r}")
    modules = dict(model.named_modules())
    found = [(n, modules[n]) for n in listed if n and n in modules]
    return found or None


def _leaf_stages(model: nn.Module) -> list[tuple[str, nn.Module]]:
    seen: set[int] = set()
    stages = []
    for name, module in model.named_modules():
        if module is model or any(True for _ in module.children()) or id(module) in seen:
            continue
        seen.add(id(module))
        stages.append((name, module))
    return stages


class StageStreamScheduler:
    """Puts each forward stage on its own CUDA stream between ``begin()`` and ``finish()``."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device | str,
        num_streams: int = 4,
        logger: WarningLogger | None = None,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.requested_streams = max(1, min(_MAX_STREAMS, int(num_streams)))
        self.stages: list[StageInfo] = []
        self.enabled = False
        self.reason = ""
        self._logger: WarningLogger = logger if logger is not None else _LOGGER
        self._streams: list[torch.cuda.Stream] = []
        self._handles: list[RemovableHandle] = []
        self._producers: dict[int, torch.cuda.Stream] = {}
        self._previous: list[torch.cuda.Stream] = []
        self._ambient: torch.cuda.Stream | None = None
        self._active = False
        self._setup()

    # -- construction ---------------------------------------------------------------------

    def _setup(self) -> None:
        if self.device.type != "cuda":
            self.reason = f"out-of-order backprop needs CUDA streams; device is {self.device.type}"
            return
        if not torch.cuda.is_available():
            self.reason = "out-of-order backprop needs CUDA streams; CUDA is not available"
            return
        try:
            declared = _declared_stages(self.model)
            modules = declared if declared is not None else _leaf_stages(self.model)
            if len(modules) < 2:
                self.reason = f"out-of-order backprop needs >= 2 stages, found {len(modules)}"
                return
            count = min(self.requested_streams, len(modules))
            self._streams = [_new_stream(self.device) for _ in range(count)]
            self.stages = [StageInfo(n, m, i % count) for i, (n, m) in enumerate(modules)]
            for stage in self.stages:
                self._install_hooks(stage)
        except Exception as exc:  # any setup failure degrades to the sequential path
            self._remove_hooks()
            self.stages = []
            self.reason = f"out-of-order backprop setup failed: {exc}"
            self._logger.warning(f"{self.reason}; continuing without it")
            return
        self.enabled = True
        self.reason = f"{len(self.stages)} stages on {len(self._streams)} CUDA streams"

    def _install_hooks(self, stage: StageInfo) -> None:
        stream = self._streams[stage.stream_index]

        def pre_hook(
            module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
        ) -> None:
            del module
            if not self._active:
                return
            for tensor in _tensors((args, kwargs)):
                producer = self._producers.get(id(tensor))
                if producer is not None and producer != stream:
                    stream.wait_stream(producer)
                if tensor.is_cuda:
                    tensor.record_stream(stream)  # the allocator must not reuse it early
            self._previous.append(torch.cuda.current_stream(self.device))
            _set_stream(stream)

        def post_hook(module: nn.Module, args: tuple[object, ...], output: object) -> None:
            del module, args
            if not self._active or not self._previous:
                return
            _set_stream(self._previous.pop())
            # Unhooked parent ops run on the ambient stream: make it wait for this stage.
            torch.cuda.current_stream(self.device).wait_stream(stream)
            for tensor in _tensors(output):
                self._producers[id(tensor)] = stream

        module = stage.module
        self._handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        self._handles.append(module.register_forward_hook(post_hook))

    # -- per-microbatch protocol -----------------------------------------------------------

    def begin(self) -> None:
        """Before a forward pass: every stage stream starts after the work queued so far."""
        if not self.enabled:
            return
        self._ambient = torch.cuda.current_stream(self.device)
        self._producers.clear()
        for stream in self._streams:
            stream.wait_stream(self._ambient)
        self._active = True

    def finish(self) -> None:
        """After the forward pass: the ambient stream waits for every stage stream (reading
        the loss on the host is safe afterwards)."""
        if not self.enabled:
            return
        self._active = False
        while self._previous:  # a forward that raised inside a stage left it entered
            _set_stream(self._previous.pop())
        current = torch.cuda.current_stream(self.device)
        for stream in self._streams:
            current.wait_stream(stream)
        self._producers.clear()
        self._ambient = None

    def remove_hooks(self) -> None:
        """Remove every forward hook this scheduler installed."""
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def dispose(self) -> None:
        """``finish()``, remove the hooks and disable (idempotent)."""
        self.finish()
        self._remove_hooks()
        if self.enabled:
            self.enabled = False
            self.reason = "disposed"

    def as_dict(self) -> dict[str, object]:
        """``{enabled, reason, streams, stages}`` for events and ``validate``."""
        return {
            "enabled": self.enabled,
            "reason": self.reason,
            "streams": len(self._streams) if self.enabled else 0,
            "stages": [stage.name for stage in self.stages],
        }

    @property
    def stage_names(self) -> Sequence[str]:
        return [stage.name for stage in self.stages]
