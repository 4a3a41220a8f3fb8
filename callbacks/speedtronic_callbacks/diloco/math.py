"""The numbers of DiLoCo: pseudo-gradients, their aggregation and the outer optimizer.

Everything here is pure tensor arithmetic on CPU state dicts (``name -> tensor``), so it
can be tested on its own and reused by the master, the workers and the benchmark.

Sign convention: a node trains from ``baseline`` to ``current``; the pseudo-gradient is
``baseline - current`` (it points the way a gradient would), and the outer optimizer
*subtracts* ``lr * nesterov(delta)`` from the global weights. With ``lr = 1``, no momentum
and one fresh delta, the new global is exactly that node's ``current``.

The delta-carry rule (``carry``): a participant that takes a new global model while it has
progress the global does not hold yet -- a hub node's unsent delta, a streaming replica's
steps since its exchange started -- takes ``global - progress`` (the global plus that
progress), so its own work stays in its weights.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence

import torch

StateDict = Mapping[str, torch.Tensor]
"""A ``name -> tensor`` mapping (a model ``state_dict`` or a delta)."""


class DeltaMismatchError(ValueError):
    """Two state dicts do not have the same keys or shapes; the message names them."""


def is_synchronised(tensor: torch.Tensor) -> bool:
    """Whether a state entry takes part in DiLoCo: floating-point and complex tensors do;
    integer and boolean buffers (counters, masks) are carried by the global file only."""
    return tensor.is_floating_point() or tensor.is_complex()


def as_real_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """A float32 view of the numbers in ``tensor``. Complex tensors become their
    ``view_as_real`` (a trailing dimension of 2), so the imaginary part is kept."""
    if tensor.is_complex():
        return torch.view_as_real(tensor.to(torch.complex64))
    return tensor.to(torch.float32)


def wire_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape an entry has in a delta file (complex entries gain a trailing 2)."""
    shape = tuple(tensor.shape)
    return (*shape, 2) if tensor.is_complex() else shape


def flatten(state: StateDict, keys: Sequence[str]) -> torch.Tensor:
    """One float32 CPU vector: ``state``'s entries of ``keys`` in that order -- the form in
    which a pseudo-gradient is packed, reduced and measured."""
    parts = [state[key].detach().reshape(-1).to("cpu", torch.float32) for key in keys]
    return torch.cat(parts) if parts else torch.zeros(0)


def unflatten(flat: torch.Tensor, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """``flatten``'s inverse: per key of ``shapes`` (in its order), a view of ``flat`` in
    that shape."""
    result: dict[str, torch.Tensor] = {}
    offset = 0
    for key, shape in shapes.items():
        count = 1
        for dim in shape:
            count *= dim
        result[key] = flat[offset : offset + count].reshape(shape)
        offset += count
    return result


def check_same_layout(expected: StateDict, actual: StateDict, *, what: str = "state") -> None:
    """Raise ``DeltaMismatchError`` naming every missing, extra or mis-shaped key."""
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    if missing or extra:
        raise DeltaMismatchError(
            f"{what} keys differ: missing {missing or 'none'}, unexpected {extra or 'none'}"
        )
    for key, tensor in expected.items():
        if tuple(actual[key].shape) != tuple(tensor.shape):
            raise DeltaMismatchError(
                f"{what} shape mismatch for {key!r}: expected {tuple(tensor.shape)}, "
                f"got {tuple(actual[key].shape)}"
            )


def pseudo_gradient(
    baseline: StateDict, current: StateDict, keys: Sequence[str] | None = None
) -> dict[str, torch.Tensor]:
    """``float32(baseline) - float32(current)`` for every synchronised key.

    ``keys`` restricts the result (tied weights are sent once); by default every floating or
    complex key of ``baseline``. Both dicts must agree on those keys and shapes, else
    ``DeltaMismatchError`` names the difference -- a partial delta is never produced.
    """
    selected = (
        list(keys)
        if keys is not None
        else sorted(key for key, value in baseline.items() if is_synchronised(value))
    )
    expected = {key: baseline[key] for key in selected if key in baseline}
    found = {key: current[key] for key in selected if key in current}
    missing_base = sorted(set(selected) - set(expected))
    if missing_base:
        raise DeltaMismatchError(f"baseline lacks keys {missing_base}")
    check_same_layout(expected, found, what="current model")
    return {
        key: as_real_fp32(baseline[key].detach().cpu()) - as_real_fp32(current[key].detach().cpu())
        for key in selected
    }


def carry(global_state: StateDict, progress: StateDict) -> dict[str, torch.Tensor]:
    """``global - progress`` for every key of ``progress`` (a pseudo-gradient: ``baseline -
    weights``), in the global's dtypes; complex entries from their wire form. The
    delta-carry rule (see the module docstring)."""
    result: dict[str, torch.Tensor] = {}
    for key, delta in progress.items():
        target = global_state[key]
        if target.is_complex():
            real = torch.view_as_real(target.to(torch.complex64)) - delta
            result[key] = torch.view_as_complex(real.contiguous()).to(target.dtype)
        else:
            wide = torch.promote_types(target.dtype, torch.float32)
            result[key] = (target.to(wide) - delta.to(wide)).to(target.dtype)
    return result


def staleness_weight(staleness: int, power: float) -> float:
    """How much a delta based on a global ``staleness`` outer steps old counts.

    The polynomial schedule of asynchronous federated optimisation: ``(1 + s) ** -power``.
    A fresh delta (s = 0) counts fully; ``power = 0`` disables the weighting.
    """
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if power < 0:
        raise ValueError(f"staleness power must be >= 0, got {power}")
    return float((1.0 + staleness) ** -power)


def aggregate_deltas(
    deltas: Sequence[StateDict], weights: Sequence[float] | None = None
) -> dict[str, torch.Tensor]:
    """``sum_i w_i * delta_i / n`` in float32 (the plain mean when every weight is 1).

    Dividing by the number of deltas rather than by the sum of weights is deliberate: a
    round made only of stale deltas moves the global model less, instead of the weights
    cancelling out.
    """
    if not deltas:
        raise ValueError("cannot aggregate an empty list of deltas")
    factors = [1.0] * len(deltas) if weights is None else [float(w) for w in weights]
    if len(factors) != len(deltas):
        raise ValueError(f"{len(factors)} weights for {len(deltas)} deltas")
    if any(w < 0 for w in factors):
        raise ValueError(f"delta weights must be >= 0, got {factors}")
    first = deltas[0]
    for other in deltas[1:]:
        check_same_layout(first, other, what="delta")
    count = float(len(deltas))
    result: dict[str, torch.Tensor] = {}
    for key in first:
        total = torch.zeros(first[key].shape, dtype=torch.float32)
        for delta, weight in zip(deltas, factors, strict=True):
            total.add_(delta[key].to(torch.float32), alpha=weight)
        result[key] = total.div_(count)
    return result


def average_deltas(deltas: Sequence[StateDict]) -> dict[str, torch.Tensor]:
    """The equal-weight float32 mean of deltas that share keys and shapes."""
    return aggregate_deltas(deltas)


class NesterovOuterOptimizer:
    """Outer SGD with Nesterov momentum over a CPU state dict (PyTorch's Nesterov form).

    For each delta key with ``g = float32(delta)``: ``b <- mu * b + g``,
    ``u <- g + mu * b``, ``theta <- theta - lr * u``. The first update is therefore
    ``(1 + mu) * g`` (1.9 g at the default mu = 0.9). Momentum buffers are float32 on CPU
    and created lazily per key.
    """

    def __init__(self, lr: float = 0.7, momentum: float = 0.9) -> None:
        if lr <= 0:
            raise ValueError(f"outer lr must be > 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"outer momentum must be in [0, 1), got {momentum}")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.buffers: dict[str, torch.Tensor] = {}

    def step(self, params: MutableMapping[str, torch.Tensor], delta: StateDict) -> None:
        """Apply one outer step to ``params`` in place. Keys of ``delta`` must exist in
        ``params`` with matching (wire) shapes; nothing is changed if one does not."""
        for key, grad in delta.items():
            if key not in params:
                raise KeyError(f"delta key {key!r} is not in the global state")
            if wire_shape(params[key]) != tuple(grad.shape):
                raise DeltaMismatchError(
                    f"delta shape {tuple(grad.shape)} for {key!r} does not match the global "
                    f"state {wire_shape(params[key])}"
                )
        for key, grad in delta.items():
            param = params[key]
            g = grad.to(torch.float32)
            buffer = self.buffers.get(key)
            if buffer is None:
                buffer = torch.zeros_like(g)
                self.buffers[key] = buffer
            buffer.mul_(self.momentum).add_(g)
            update = g.add(buffer, alpha=self.momentum)
            target = torch.view_as_real(param) if param.is_complex() else param
            target.sub_((update * self.lr).to(target.dtype))

    def state_dict(self) -> dict[str, object]:
        """The momentum buffers (cloned) plus the hyper-parameters they were built with."""
        return {
            "lr": self.lr,
            "momentum": self.momentum,
            "buffers": {key: value.clone() for key, value in self.buffers.items()},
        }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore the momentum buffers (as CPU float32 copies). The configured lr and
        momentum coefficient are kept: a changed config wins over a checkpoint."""
        buffers = state.get("buffers", {})
        if not isinstance(buffers, Mapping):
            raise TypeError("outer optimizer state 'buffers' must be a mapping")
        restored: dict[str, torch.Tensor] = {}
        for key, value in buffers.items():
            if not isinstance(key, str) or not isinstance(value, torch.Tensor):
                raise TypeError(f"bad momentum buffer entry {key!r}")
            restored[key] = value.detach().to("cpu", torch.float32).clone()
        self.buffers = restored
