"""Loading a training state with many parameter tensors: ``trainer.load_state_dict`` against
torch's own ``Optimizer.load_state_dict`` of the same optimizer state.

torch's optimizer load asks ``id in group["params"]`` (a list) once per state tensor, so it
is quadratic in the number of parameter tensors; speedtronic hands it indexed groups
(``speedtronic.state.optimizer_load``). The model is a list of 2-element parameters, so the
count of tensors, not their size, decides the time. Best of ``--repeats`` per size.

    python benchmarks/state_load.py --sizes 400 4000 20000
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from speedtronic.engine.trainer import Trainer


class ManyTensors(nn.Module):
    def __init__(self, count: int) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.zeros(2)) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([w.sum() for w in self.weights]).sum() * x.sum()


def best_of(repeats: int, work: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(count: int, repeats: int) -> tuple[float, float]:
    """Best-of-``repeats`` seconds: the trainer's load, and torch's optimizer load alone."""
    model = ManyTensors(count)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = Trainer(model, optimizer, [torch.ones(1)] * 2, max_steps=1)
    trainer.fit()
    state = trainer.state_dict()
    optimizer_state = optimizer.state_dict()
    ours = best_of(repeats, lambda: trainer.load_state_dict(state))
    return ours, best_of(repeats, lambda: optimizer.load_state_dict(optimizer_state))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", type=int, nargs="+", default=[400, 4000, 20000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("| parameter tensors | trainer.load_state_dict | torch optimizer.load_state_dict |")
    print("|---|---|---|")
    for count in args.sizes:
        ours, torchs = measure(count, args.repeats)
        print(f"| {count:,} | {ours:.3f} s | {torchs:.3f} s |", flush=True)


if __name__ == "__main__":
    main()
