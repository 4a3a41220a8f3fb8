"""Loop overhead: a hand-written PyTorch loop versus speedtronic's Trainer, side by side.

The same tiny model (the smoke-sized reference transformer), the same pre-collated batches
and the same work per step (K=2 accumulation, AdamW, warmup+cosine LR, loss and lr written
to a log file on logging steps). Runs are interleaved in ABBA order; the table shows the
median steps/s of each side and the median of the per-round paired ratios.

    python benchmarks/overhead.py            # prints a table; --markdown for docs

Cases:
  trainer_bare       Trainer, no callbacks
  trainer_defaults   Trainer with the default callbacks (console to a file + metrics.jsonl),
                     logging every 10 steps (the hand loop logs every 10 too)
  trainer_all_sinks  console + jsonl + csv + tensorboard + progress (non-TTY), every step,
                     against a hand loop that logs every step
  lightning_bare     Lightning's Trainer (when ``lightning`` is installed) with its logger,
                     progress bar, checkpointing and model summary off: its fastest setup
  mlp_bare           the framework's own cost: a tiny MLP (~1 ms/step), K=1, plain Adam,
                     metrics due every 100 steps, Trainer without callbacks
  mlp_20_callbacks   the same with 20 no-op callbacks, each listening to one per-step event
  mlp_lightning      Lightning on the tiny MLP (when installed)
  scalar_bare        a four-weight model and SGD, 3000 steps: a step is almost all loop
                     overhead, so the Trainer's own µs/step stand out of the machine's noise
  scalar_20_callbacks  the same with the 20 no-op callbacks

The MLP cases are reported as the Trainer's extra cost in µs/step over the hand-written loop
(median of the per-round paired differences, and the difference of the best rounds) next to
the steps/s ratio. Targets (issue 10): ≤ 25 µs/step bare, ≤ 40 µs/step with 20 callbacks.

    python benchmarks/overhead.py --cases mlp_bare,mlp_20_callbacks --rounds 11
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from speedtronic import Callback, Event, Trainer
from speedtronic.data import LearnableLanguageDataset, collate_batch
from speedtronic.model import ReferenceTransformer  # the 2.0 path: --baseline trees have it too

STEPS = 300
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]
K = 2
MICRO = 8


def make_model() -> ReferenceTransformer:
    torch.manual_seed(0)
    return ReferenceTransformer(
        vocab_size=128, block_size=32, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128
    )


def make_batches() -> list[object]:
    data = LearnableLanguageDataset(num_samples=64 * MICRO, block_size=32, vocab_size=128, seed=1)
    return [collate_batch([data[i * MICRO + j] for j in range(MICRO)]) for i in range(64)]


def lr_lambda(step: int) -> float:
    warmup = 10
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, STEPS - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def optimizer_for(
    model: torch.nn.Module,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)


def hand_loop(batches: list[object], log_every: int, log_path: Path) -> float:
    model = make_model()
    opt, sched = optimizer_for(model)
    model.train()
    start = clock()
    with log_path.open("w") as log:
        position = 0
        for step in range(1, STEPS + 1):
            total = torch.zeros(())
            for _ in range(K):
                batch = batches[position % len(batches)]
                position += 1
                assert isinstance(batch, dict)
                out = model(**batch)
                loss = out["loss"]
                (loss / K).backward()
                total += loss.detach()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            if step % log_every == 0:
                log.write(
                    f"step {step} loss {(total / K).item():.4f} lr {sched.get_last_lr()[0]}\n"
                )
    return STEPS / (clock() - start)


def trainer_run(
    batches: list[object],
    callbacks: Callable[[Path], list[Callback]],
    log_every: int,
    out: Path,
    model_factory: Callable[[], torch.nn.Module] = make_model,
) -> float:
    model = model_factory()
    opt, sched = optimizer_for(model)
    trainer = Trainer(
        model,
        opt,
        batches,
        device="cpu",
        scheduler=sched,
        callbacks=callbacks(out),
        accumulation_steps=K,
        max_steps=STEPS,
        metrics_every=log_every,
        output_dir=out,
    )
    start = clock()
    trainer.fit()
    return STEPS / (clock() - start)


def default_callbacks(out: Path) -> list[Callback]:
    from speedtronic_callbacks.console import ConsoleCallback
    from speedtronic_callbacks.jsonl import JsonlCallback

    return [ConsoleCallback(file=out / "console.log"), JsonlCallback(out / "metrics.jsonl")]


def all_sinks(out: Path) -> list[Callback]:
    from speedtronic_callbacks.csv_sink import CsvCallback
    from speedtronic_callbacks.progress import ProgressBarCallback
    from speedtronic_callbacks.tensorboard import TensorBoardCallback

    progress_log = (out / "progress.log").open("w")
    return [
        *default_callbacks(out),
        CsvCallback(out / "metrics.csv"),
        TensorBoardCallback(out / "tensorboard"),
        ProgressBarCallback(stream=progress_log),
    ]


def lightning_run(batches: list[object], out: Path) -> float:
    import lightning as L  # optional: pip install lightning "torch==<your torch>"

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss: torch.Tensor = self.net(**batch)["loss"]
            return loss

        def configure_optimizers(self) -> object:
            opt, sched = optimizer_for(self.net)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    trainer = L.Trainer(
        max_steps=STEPS,
        accumulate_grad_batches=K,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
        num_sanity_val_steps=0,
    )
    loader = torch.utils.data.DataLoader(batches * 10, batch_size=None, shuffle=False)
    start = clock()
    trainer.fit(Module(), loader)
    return STEPS / (clock() - start)


# -- the tiny MLP: the framework's own per-step cost ---------------------------------------

MLP_STEPS = 600
MLP_LOG_EVERY = 100


class TinyMLP(torch.nn.Module):
    """~0.1M parameters; about 1 ms per training step on one CPU thread."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(128, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 10),
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.net(x), y)


def make_mlp() -> TinyMLP:
    torch.manual_seed(0)
    return TinyMLP()


def mlp_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(32, 128, generator=generator),
            torch.randint(0, 10, (32,), generator=generator),
        )
        for _ in range(32)
    ]


Batches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class SmallCase:
    """A model small enough that the loop's own cost shows: how to build it, its
    optimizer, and how many steps one run takes."""

    make_model: Callable[[], torch.nn.Module]
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]
    steps: int


def small_hand_loop(case: SmallCase, batches: Batches, log_path: Path) -> float:
    model = case.make_model()
    opt = case.make_optimizer(model)
    model.train()
    start = clock()
    with log_path.open("w") as log:
        for step in range(1, case.steps + 1):
            x, y = batches[(step - 1) % len(batches)]
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % MLP_LOG_EVERY == 0:
                log.write(f"step {step} loss {loss.item():.4f}\n")
    return case.steps / (clock() - start)


class NoOp(Callback):
    """Listens to one per-step event and does nothing."""

    def __init__(self, event: Event) -> None:
        self.event = event


PER_STEP_EVENTS = (
    Event.STEP_START,
    Event.MICROBATCH_START,
    Event.BEFORE_BACKWARD,
    Event.AFTER_BACKWARD,
    Event.MICROBATCH_END,
    Event.BEFORE_OPTIMIZER_STEP,
    Event.AFTER_OPTIMIZER_STEP,
    Event.AFTER_SCHEDULER_STEP,
    Event.COORDINATE,
    Event.CHECKPOINT,
    Event.STEP_END,
)


def no_op_callbacks(count: int) -> list[Callback]:
    """``count`` callbacks, each overriding the hook of one per-step event (round robin)."""
    made: list[Callback] = []
    for index in range(count):
        event = PER_STEP_EVENTS[index % len(PER_STEP_EVENTS)]

        def hook(self: Callback, trainer: object, ctx: object) -> None:
            del self, trainer, ctx

        cls = type(f"NoOp{index}", (NoOp,), {event.hook_name: hook})
        made.append(cls(event))
    return made


def small_trainer_run(case: SmallCase, batches: Batches, callbacks: int, out: Path) -> float:
    model = case.make_model()
    trainer = Trainer(
        model,
        case.make_optimizer(model),
        batches,
        device="cpu",
        callbacks=no_op_callbacks(callbacks),
        max_steps=case.steps,
        metrics_every=MLP_LOG_EVERY,
        output_dir=out,
    )
    start = clock()
    trainer.fit()
    return case.steps / (clock() - start)


MLP_CASE = SmallCase(
    make_mlp, lambda model: torch.optim.Adam(model.parameters(), lr=1e-3), MLP_STEPS
)


# -- a near-empty model: nothing but the framework's own cost ------------------------------

class ScalarModel(torch.nn.Module):
    """Four weights and a squared error: a step is almost only loop overhead, so the
    Trainer's extra µs/step stand out of the machine's noise (on a shared VM the MLP's
    step time swings by more than the overhead being measured)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.w * x).sum() - y).square()


def scalar_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    return [(torch.randn(4, generator=generator), torch.randn((), generator=generator))] * 32


SCALAR_CASE = SmallCase(
    ScalarModel, lambda model: torch.optim.SGD(model.parameters(), lr=1e-3), 3000
)


def mlp_lightning_run(batches: list[tuple[torch.Tensor, torch.Tensor]], out: Path) -> float:
    import lightning as L  # optional: pip install lightning "torch==<your torch>"

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_mlp()

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss: torch.Tensor = self.net(*batch)
            return loss

        def configure_optimizers(self) -> object:
            return torch.optim.Adam(self.net.parameters(), lr=1e-3)

    trainer = L.Trainer(
        max_steps=MLP_STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
        num_sanity_val_steps=0,
        log_every_n_steps=MLP_LOG_EVERY,
    )
    loader = torch.utils.data.DataLoader(batches * 20, batch_size=None, shuffle=False)
    start = clock()
    trainer.fit(Module(), loader)
    return MLP_STEPS / (clock() - start)


def us_per_step(hand_rates: list[float], our_rates: list[float]) -> tuple[float, float]:
    """The other side's extra µs/step over the hand loop: median of paired differences,
    and the difference of the best (fastest) runs."""
    paired = statistics.median(
        (1 / ours - 1 / hand) * 1e6 for hand, ours in zip(hand_rates, our_rates, strict=True)
    )
    best = (1 / max(our_rates) - 1 / max(hand_rates)) * 1e6
    return paired, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall time (default) or this process's CPU time (stabler on a shared machine)",
    )
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    torch.set_num_threads(1)
    batches = make_batches()
    small = mlp_batches()
    cases: dict[str, tuple[Callable[[Path], float], Callable[[Path], float]]] = {
        "trainer_bare": (
            lambda d: hand_loop(batches, 10, d / "hand.log"),
            lambda d: trainer_run(batches, lambda _: [], 10, d),
        ),
        "trainer_defaults": (
            lambda d: hand_loop(batches, 10, d / "hand.log"),
            lambda d: trainer_run(batches, default_callbacks, 10, d),
        ),
        "trainer_all_sinks": (
            lambda d: hand_loop(batches, 1, d / "hand.log"),
            lambda d: trainer_run(batches, all_sinks, 1, d),
        ),
    }
    cases["mlp_bare"] = (
        lambda d: small_hand_loop(MLP_CASE, small, d / "hand.log"),
        lambda d: small_trainer_run(MLP_CASE, small, 0, d),
    )
    cases["mlp_20_callbacks"] = (
        lambda d: small_hand_loop(MLP_CASE, small, d / "hand.log"),
        lambda d: small_trainer_run(MLP_CASE, small, 20, d),
    )
    scalar = scalar_batches()
    cases["scalar_bare"] = (
        lambda d: small_hand_loop(SCALAR_CASE, scalar, d / "hand.log"),
        lambda d: small_trainer_run(SCALAR_CASE, scalar, 0, d),
    )
    cases["scalar_20_callbacks"] = (
        lambda d: small_hand_loop(SCALAR_CASE, scalar, d / "hand.log"),
        lambda d: small_trainer_run(SCALAR_CASE, scalar, 20, d),
    )
    try:
        import lightning  # noqa: F401

        cases["lightning_bare"] = (
            lambda d: hand_loop(batches, 10, d / "hand.log"),
            lambda d: lightning_run(batches, d),
        )
        cases["mlp_lightning"] = (
            lambda d: small_hand_loop(MLP_CASE, small, d / "hand.log"),
            lambda d: mlp_lightning_run(small, d),
        )
    except ImportError:
        print("(lightning not installed: skipping the Lightning comparison)")
    if args.cases:
        wanted = args.cases.split(",")
        cases = {name: cases[name] for name in wanted}
    rows = []
    for name, (hand, ours) in cases.items():
        hand_rates, our_rates = [], []
        hand(Path(tempfile.mkdtemp()))  # warm-up both paths once
        ours(Path(tempfile.mkdtemp()))
        for round_index in range(args.rounds):
            # ABBA order: neither side always runs first (allocator and cache warmth).
            pair = [(hand, hand_rates), (ours, our_rates)]
            for run, rates in pair if round_index % 2 == 0 else reversed(pair):
                rates.append(run(Path(tempfile.mkdtemp())))
        h, o = statistics.median(hand_rates), statistics.median(our_rates)
        # The ratio is the median of each round's paired ratio: robust to the machine's
        # speed drifting between rounds, which moves both runs of a pair together.
        paired = statistics.median(
            ours / hand for hand, ours in zip(hand_rates, our_rates, strict=True)
        )
        extra, best = us_per_step(hand_rates, our_rates)
        rows.append((name, h, o, paired, extra, best))
    if args.markdown:
        print(
            "| case | hand-written steps/s | other steps/s | paired ratio "
            "| extra µs/step (median) | extra µs/step (best) |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        for name, h, o, r, extra, best in rows:
            print(f"| {name} | {h:.1f} | {o:.1f} | {r:.3f} | {extra:.1f} | {best:.1f} |")
    else:
        for name, h, o, r, extra, best in rows:
            print(
                f"{name:<20} hand {h:8.1f} steps/s   other {o:8.1f} steps/s   ratio {r:.3f}"
                f"   +{extra:.1f} µs/step (median)   +{best:.1f} µs/step (best)"
            )


if __name__ == "__main__":
    main()
