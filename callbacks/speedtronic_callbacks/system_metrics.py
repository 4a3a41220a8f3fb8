"""``system_metrics``: device and host memory, CPU use and model-FLOPs utilisation, added to
due records.

A contributor: it runs before the sinks at the ``metrics`` event and only on due steps, so
it adds no work to steps on which nothing is logged. Keys it adds:

* ``memory_bytes`` -- memory currently allocated by tensors on the trainer's device
  (``torch.cuda.memory_allocated(device)``; MPS: ``torch.mps.current_allocated_memory()``).
  CPU reports nothing, so on CPU the key is absent. These are allocator counters: reading
  them does not synchronise the device.
* ``memory_peak_bytes`` -- CUDA only: the peak since the fit started.
* ``host/rss_bytes`` / ``host/cpu_percent`` -- this process on the host, on every device
  (the CPU machine included): resident memory (psutil when installed, else
  ``/proc/self/statm`` on Linux) and CPU time over wall time since the previous due record,
  in percent of one core (``top``'s convention: 400 is four busy cores). DataLoader worker
  processes are not counted.
* ``flops_per_sec`` / ``mfu`` -- when the model has ``flops_per_token(seq_len)`` (training
  FLOPs per token, forward + backward; the reference model has it): achieved model FLOP/s
  over the window since the previous due record, and that divided by the device's peak
  FLOP/s (``mfu``, a fraction). The peak is the ``peak_flops`` option, or for 16-bit
  precision on a few well-known CUDA GPUs, their dense bf16/fp16 tensor-core peak.

What an option asks for but this run cannot give (device memory on a CPU without the host
keys, FLOP counts of a model without ``flops_per_token``, ``mfu`` without a known peak, the
host's memory without psutil or ``/proc``) is said once, at ``setup``, in one warning.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, ClassVar, Protocol, runtime_checkable

import torch

from speedtronic.config.declare import Opt, plugin
from speedtronic.engine.callback import Callback, RankPolicy
from speedtronic.engine.contexts import FitContext, MetricsContext
from speedtronic.engine.filters import METRICS_ON_LOGGING_STEPS
from speedtronic.systems.memory import memory_usage_bytes
from speedtronic.user_warnings import warn

if TYPE_CHECKING:
    from speedtronic.engine.view import TrainerView

# Dense (no sparsity) bf16/fp16 tensor-core peaks from the vendors' data sheets, FLOP/s.
# Matched against torch.cuda.get_device_name() in order, first hit wins.
_KNOWN_16BIT_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100", 989.4e12),
    ("A100", 312.0e12),
    ("L40S", 362.0e12),
    ("L40", 181.0e12),
    ("L4", 121.0e12),
    ("V100", 125.0e12),
    ("T4", 65.0e12),
)


@runtime_checkable
class CountsFlops(Protocol):
    """A model that knows its training FLOPs per token (forward + backward)."""

    def flops_per_token(self, seq_len: int | None = None) -> int: ...


def _known_peak_flops(device: torch.device, precision_mode: str) -> float | None:
    """The dense 16-bit peak of a known CUDA GPU, when training in bf16/fp16."""
    if device.type != "cuda" or precision_mode not in ("bf16", "fp16"):
        return None
    name = torch.cuda.get_device_name(device)
    for pattern, peak in _KNOWN_16BIT_PEAK_FLOPS:
        if pattern in name:
            return peak
    return None


def _statm_rss() -> int | None:
    """Resident memory from Linux's ``/proc/self/statm`` (pages), else None."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _resident_memory_probe() -> Callable[[], int | None] | None:
    """A function reading this process's resident memory in bytes: psutil's when it is
    installed, else Linux's ``/proc``; None when the host offers neither."""
    try:
        import psutil
    except ImportError:  # optional: the dev extra has it, a bare install may not
        return _statm_rss if _statm_rss() is not None else None
    process = psutil.Process()

    def rss() -> int | None:
        return process.memory_info().rss

    return rss


@dataclass(frozen=True)
class SystemMetricsOptions:
    """The ``system_metrics`` contributor's options."""

    memory: Annotated[
        bool, Opt("add the device memory keys (`memory_bytes`, `memory_peak_bytes` on CUDA)")
    ] = True
    host: Annotated[bool, Opt("add `host/rss_bytes` and `host/cpu_percent` (this process)")] = True
    mfu: Annotated[bool, Opt("add `flops_per_sec` and `mfu` when the model counts its FLOPs")] = (
        True
    )
    peak_flops: Annotated[
        float | None,
        Opt(
            "the device's peak FLOP/s for MFU; `null`: a built-in table of CUDA GPUs "
            "(16-bit precision only)",
            exclusive_minimum=0,
        ),
    ] = None


@plugin("system_metrics", options=SystemMetricsOptions)
class SystemMetricsCallback(Callback):
    """Adds device memory, this process's host memory and CPU use and (when computable)
    ``flops_per_sec``/``mfu`` to due records."""

    is_observer: ClassVar[bool] = True  # a failing probe must not stop training
    rank_policy: ClassVar[RankPolicy] = "main"  # feeds the sinks, which run on rank 0
    due_when = METRICS_ON_LOGGING_STEPS  # on_metrics only on logging steps

    def __init__(
        self,
        *,
        memory: bool = SystemMetricsOptions.memory,
        mfu: bool = SystemMetricsOptions.mfu,
        peak_flops: float | None = SystemMetricsOptions.peak_flops,
        host: bool = SystemMetricsOptions.host,
    ) -> None:
        if peak_flops is not None and peak_flops <= 0:
            raise ValueError(f"peak_flops must be positive, got {peak_flops}")
        self.memory = memory
        self.mfu = mfu
        self.peak_flops = peak_flops
        self.host = host
        self._rss: Callable[[], int | None] | None = None
        self._cpu_window: tuple[float, float] = (0.0, 0.0)  # (wall, process CPU) seconds
        self._resolved_peak: float | None = None
        self._flops_cache: dict[int, int] = {}
        self._window: tuple[float, int, int] = (0.0, 0, 0)  # (time, samples, tokens)

    def on_setup(self, trainer: TrainerView, ctx: FitContext) -> None:
        self._window = (time.perf_counter(), trainer.samples, trainer.tokens)
        self._flops_cache.clear()
        self._resolved_peak = self.peak_flops or _known_peak_flops(
            trainer.device, trainer.precision_mode
        )
        if self.memory and trainer.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.device)
        self._rss = _resident_memory_probe() if self.host else None
        self._cpu_window = (time.perf_counter(), time.process_time())
        missing = self._unavailable(trainer)
        if missing:
            warn(f"{self.display_name}: {'; '.join(missing)}", UserWarning)

    def _unavailable(self, trainer: TrainerView) -> list[str]:
        """What the options ask for that this run cannot log, each with the reason."""
        missing = []
        if self.memory and memory_usage_bytes(trainer.device) is None and not self.host:
            missing.append(
                f"no memory_bytes: {trainer.device.type} has no device memory counters "
                "(host: true logs this process's memory)"
            )
        if self.host and self._rss is None:
            missing.append("no host/rss_bytes: it needs psutil here (pip install psutil)")
        if self.mfu and not isinstance(trainer.model, CountsFlops):
            missing.append(
                "no flops_per_sec or mfu: the model has no flops_per_token(seq_len) method"
            )
        elif self.mfu and self._resolved_peak is None:
            missing.append(
                f"no mfu: the peak FLOP/s of {trainer.device.type} in "
                f"{trainer.precision_mode} is not known (set the peak_flops option)"
            )
        return missing

    def on_metrics(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        if self.memory:
            self._add_memory(trainer, ctx)
        if self.host:
            self._add_host(ctx)
        if self.mfu:
            self._add_flops(trainer, ctx)

    def _add_host(self, ctx: MetricsContext) -> None:
        if self._rss is not None:
            rss = self._rss()
            if rss is not None:
                ctx.record.set("host/rss_bytes", rss)
        now, cpu = time.perf_counter(), time.process_time()
        then, cpu_then = self._cpu_window
        self._cpu_window = (now, cpu)
        if now > then:
            ctx.record.set("host/cpu_percent", 100.0 * (cpu - cpu_then) / (now - then))

    def _add_memory(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        allocated = memory_usage_bytes(trainer.device)
        if allocated is not None:
            ctx.record.set("memory_bytes", allocated)
        if trainer.device.type == "cuda":
            ctx.record.set("memory_peak_bytes", torch.cuda.max_memory_allocated(trainer.device))

    def _flops_per_token(self, model: CountsFlops, seq_len: int) -> int:
        cached = self._flops_cache.get(seq_len)
        if cached is None:
            cached = self._flops_cache[seq_len] = int(model.flops_per_token(seq_len))
        return cached

    def _add_flops(self, trainer: TrainerView, ctx: MetricsContext) -> None:
        now = time.perf_counter()
        start, samples0, tokens0 = self._window
        self._window = (now, trainer.samples, trainer.tokens)
        model = trainer.model
        samples, tokens = trainer.samples - samples0, trainer.tokens - tokens0
        if not isinstance(model, CountsFlops) or samples <= 0 or tokens <= 0 or now <= start:
            return
        seq_len = max(1, round(tokens / samples))
        flops_per_sec = self._flops_per_token(model, seq_len) * tokens / (now - start)
        ctx.record.set("flops_per_sec", flops_per_sec)
        if self._resolved_peak is not None:
            ctx.record.set("mfu", flops_per_sec / self._resolved_peak)
