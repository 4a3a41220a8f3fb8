"""Optimizer benchmark: AdamW vs Muon vs Muon+cautious, and our Muon vs ``torch.optim.Muon``.

1. Steps (and CPU wall time) to reach a fixed held-out loss on the learnable synthetic
   language (``LearnableLanguageDataset``), same reference transformer for every optimizer.
   Each optimizer gets a small learning-rate sweep on a sweep seed; the best setting is then
   run on fresh seeds, interleaved (seed 1: AdamW, Muon, Muon+cautious; seed 2: ...), so
   machine noise hits every optimizer alike.
2. Optimizer step time of ``speedtronic.optimizers.Muon`` against ``torch.optim.Muon`` on the
   same matrices (the hidden matrices of reference transformers of several widths), timed
   interleaved, median of repeats.

    python benchmarks/optimizers.py                 # ~3-4 minutes on 2 CPU cores
    python benchmarks/optimizers.py --quick         # a smoke run (seconds)
    python benchmarks/optimizers.py --write-docs    # also update docs/optimizers.md

Single-threaded (``torch.set_num_threads(1)``) so results are comparable across machines.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from speedtronic.config import OptimizerConfig
from speedtronic.data import LearnableLanguageDataset
from speedtronic.models.transformer import ReferenceTransformer
from speedtronic.optimizers import (
    CPU_BF16_MIN_SIDE,
    Muon,
    build_optimizer,
    build_scheduler,
    ns_work_dtype,
    route_parameters,
)

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "optimizers.md"
START_MARK = "<!-- benchmark:start -->"
END_MARK = "<!-- benchmark:end -->"


# -- settings (structurally the config sections the builders read) ---------------------------


def optimizer_choice(**settings: object) -> OptimizerConfig:
    """The run's optimizer section: the validated config dataclass, lr 3e-3 unless given."""
    return OptimizerConfig(**{"lr": 3e-3, **settings})  # type: ignore[arg-type]  # checked by the dataclass


@dataclass(frozen=True)
class Schedule:
    name: str = "constant"
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1


@dataclass(frozen=True)
class Task:
    """The fixed problem: data, model shape, target and budget."""

    vocab_size: int = 64
    block_size: int = 32
    batch_size: int = 16
    d_model: int = 64
    n_layer: int = 2
    eval_every: int = 10
    eval_sequences: int = 256
    max_steps: int = 400
    # The headline target is close to the floor: reaching it means the chain is learned,
    # not just its unigram/bigram statistics (which the embedding, on AdamW in every run,
    # picks up in the first few dozen steps). Looser targets are reported alongside.
    target_gap: float = 0.1
    extra_gaps: tuple[float, ...] = (0.5, 0.25, 0.15)  # reported alongside, never tuned for


@dataclass(frozen=True)
class Family:
    """An optimizer and the values of its swept learning rate."""

    label: str
    base: OptimizerConfig
    sweep: tuple[float, ...]
    swept: str  # "lr" or "muon_lr"

    def at(self, value: float) -> OptimizerConfig:
        if self.swept == "lr":
            return replace(self.base, lr=value)
        return replace(self.base, muon_lr=value)


@dataclass(frozen=True)
class RunResult:
    steps: int | None  # to the headline target; None: not reached within the budget
    seconds: float  # CPU training time (no evaluation) until then
    final_loss: float
    steps_to_gap: dict[float, int | None]  # every reported target, by its gap to the floor


# -- the training runs ---------------------------------------------------------------------------


class Problem:
    """Pre-generated token batches (data generation is not timed) and the held-out set."""

    def __init__(self, task: Task, data_seed: int = 7) -> None:
        self.task = task
        train = task.batch_size * task.max_steps
        dataset = LearnableLanguageDataset(
            num_samples=train + task.eval_sequences,
            block_size=task.block_size,
            vocab_size=task.vocab_size,
            seed=data_seed,
        )
        items = [dataset[i] for i in range(len(dataset))]
        self.inputs = torch.stack([item["input_ids"] for item in items])
        self.labels = torch.stack([item["labels"] for item in items])
        self.train_count = train
        self.target = dataset.entropy_floor + task.target_gap
        self.floor = dataset.entropy_floor
        self.gaps = tuple(sorted({task.target_gap, *task.extra_gaps}, reverse=True))

    def model(self, seed: int) -> ReferenceTransformer:
        torch.manual_seed(seed)
        task = self.task
        return ReferenceTransformer(
            vocab_size=task.vocab_size,
            block_size=task.block_size,
            n_layer=task.n_layer,
            n_head=4,
            n_kv_head=2,
            d_model=task.d_model,
            d_ff=2 * task.d_model,
        )

    def eval_loss(self, model: nn.Module) -> float:
        start = self.train_count
        with torch.no_grad():
            out = model(self.inputs[start:], labels=self.labels[start:])
        return float(out["loss"])

    def run(self, choice: OptimizerConfig, seed: int) -> RunResult:
        task = self.task
        model = self.model(seed)
        optimizer = build_optimizer(model, choice, torch.device("cpu"))
        scheduler = build_scheduler(optimizer, Schedule(), task.max_steps)
        order = torch.randperm(self.train_count, generator=torch.Generator().manual_seed(seed))
        seconds, loss = 0.0, math.inf
        reached: dict[float, int | None] = dict.fromkeys(self.gaps)
        headline: tuple[int, float] | None = None
        for step in range(1, task.max_steps + 1):
            rows = order[(step - 1) * task.batch_size : step * task.batch_size]
            began = time.thread_time()  # CPU time: robust to other load on the machine
            optimizer.zero_grad(set_to_none=True)
            model(self.inputs[rows], labels=self.labels[rows])["loss"].backward()
            optimizer.step()
            scheduler.step()
            seconds += time.thread_time() - began
            if step % task.eval_every:
                continue
            loss = self.eval_loss(model)
            if not math.isfinite(loss):
                break
            for gap in self.gaps:
                if reached[gap] is None and loss <= self.floor + gap:
                    reached[gap] = step
            if headline is None and reached[task.target_gap] is not None:
                headline = (step, seconds)
            if all(value is not None for value in reached.values()):
                break
        steps, at = headline if headline is not None else (None, seconds)
        return RunResult(steps, at, loss, reached)


def families(quick: bool) -> list[Family]:
    adamw = optimizer_choice(name="adamw")
    muon = optimizer_choice(name="muon")
    cautious = replace(muon, cautious=True)
    if quick:
        return [
            Family("AdamW", adamw, (3e-3,), "lr"),
            Family("Muon", muon, (2e-2,), "muon_lr"),
            Family("Muon+cautious", cautious, (2e-2,), "muon_lr"),
        ]
    return [
        Family("AdamW", adamw, (3e-3, 5e-3, 1e-2, 2e-2), "lr"),
        Family("Muon", muon, (1e-2, 2e-2, 4e-2, 8e-2), "muon_lr"),
        Family("Muon+cautious", cautious, (1e-2, 2e-2, 4e-2, 8e-2), "muon_lr"),
    ]


def _rank(result: RunResult) -> tuple[float, float]:
    return (result.steps if result.steps is not None else math.inf, result.final_loss)


@dataclass
class Comparison:
    sweep: dict[str, list[tuple[float, RunResult]]]
    best: dict[str, float]
    seeds: list[int]
    runs: dict[str, list[RunResult]]


def compare(
    problem: Problem, chosen: list[Family], seeds: Sequence[int], log: Callable[[str], None]
) -> Comparison:
    sweep: dict[str, list[tuple[float, RunResult]]] = {f.label: [] for f in chosen}
    aux_lr = chosen[0].base.lr
    for family in chosen:
        for value in family.sweep:
            choice = family.at(value)
            if family.label != "AdamW":
                choice = replace(choice, lr=aux_lr)  # Muon's AdamW branch uses AdamW's best
            result = problem.run(choice, seed=0)
            sweep[family.label].append((value, result))
            log(f"sweep {family.label} {family.swept}={value:g}: {_describe(result)}")
        if family.label == "AdamW":
            aux_lr = min(sweep["AdamW"], key=lambda item: _rank(item[1]))[0]
    best = {
        label: min(results, key=lambda item: _rank(item[1]))[0] for label, results in sweep.items()
    }
    runs: dict[str, list[RunResult]] = {f.label: [] for f in chosen}
    for seed in seeds:  # interleaved: every optimizer on seed s before any on seed s+1
        for family in chosen:
            choice = family.at(best[family.label])
            if family.label != "AdamW":
                choice = replace(choice, lr=best["AdamW"])
            result = problem.run(choice, seed)
            runs[family.label].append(result)
            log(f"seed {seed} {family.label}: {_describe(result)}")
    return Comparison(sweep, best, list(seeds), runs)


def _describe(result: RunResult) -> str:
    reached = f"{result.steps} steps" if result.steps is not None else "not reached"
    return f"{reached}, {result.seconds:.2f} s, eval loss {result.final_loss:.3f}"


# -- step time: our Muon vs torch.optim.Muon -------------------------------------------------------


def hidden_shapes(
    d_model: int, n_layer: int = 2, n_head: int = 4, n_kv_head: int = 2
) -> list[tuple[int, int]]:
    """The Muon-routed matrices of a reference transformer of this width."""
    model = ReferenceTransformer(
        vocab_size=64,
        block_size=8,
        n_layer=n_layer,
        n_head=n_head,
        n_kv_head=n_kv_head,
        d_model=d_model,
        d_ff=4 * d_model,
    )
    routing = route_parameters(model)
    return [(p.shape[0], p.shape[1]) for _, p in routing.muon]


def _optimizer_on(
    make: Callable[[list[nn.Parameter]], torch.optim.Optimizer], shapes: Sequence[tuple[int, int]]
) -> torch.optim.Optimizer:
    generator = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(*s, generator=generator)) for s in shapes]
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)
    optimizer = make(params)
    optimizer.step()  # warm-up: lazily created state, first-call kernels
    return optimizer


def _cpu_seconds(action: Callable[[], object]) -> float:
    """CPU time of this thread (torch runs single-threaded here), so other processes on a
    busy machine do not count against whichever implementation happened to be running."""
    began = time.thread_time()
    action()
    return time.thread_time() - began


def step_time_table(widths: Sequence[int], repeats: int, log: Callable[[str], None]) -> list[str]:
    makers: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
        "torch.optim.Muon": lambda ps: torch.optim.Muon(ps, lr=0.02, weight_decay=0.0),
        "ours (auto)": lambda ps: Muon(ps, lr=0.02),
        "ours (fp32)": lambda ps: Muon(ps, lr=0.02, ns_dtype="float32"),
    }
    rows = [
        "| d_model | matrices | torch.optim.Muon ms | ours (auto) ms | ours/torch "
        "| ours, fp32 NS ms |",
        "|---|---|---|---|---|---|",
    ]
    for width in widths:
        shapes = hidden_shapes(width)
        optimizers = {name: _optimizer_on(make, shapes) for name, make in makers.items()}
        samples: dict[str, list[float]] = {name: [] for name in makers}
        for _ in range(repeats):  # alternate single steps: drift hits every one alike
            for name, optimizer in optimizers.items():
                samples[name].append(_cpu_seconds(optimizer.step))
        median = {name: 1e3 * statistics.median(values) for name, values in samples.items()}
        ratio = median["ours (auto)"] / median["torch.optim.Muon"]
        log(
            f"step time d_model={width}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in median.items())
        )
        rows.append(
            f"| {width} | {len(shapes)} | {median['torch.optim.Muon']:.2f} | "
            f"{median['ours (auto)']:.2f} | {ratio:.2f} | {median['ours (fp32)']:.2f} |"
        )
    return rows


# -- report -------------------------------------------------------------------------------------


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _mean_steps(values: Sequence[int | None]) -> float | None:
    """Mean steps over seeds, or None when any seed missed the target."""
    if any(v is None for v in values):
        return None
    return _mean([float(v) for v in values if v is not None])


def _task_text(problem: Problem) -> str:
    task = problem.task
    return (
        f"Task: `LearnableLanguageDataset(vocab_size={task.vocab_size}, "
        f"block_size={task.block_size})`, entropy floor {problem.floor:.3f} nats. Headline "
        f"target: held-out loss {problem.target:.3f} (floor + {task.target_gap}), evaluated "
        f"every {task.eval_every} steps on {task.eval_sequences} held-out sequences. Model: "
        f"`ReferenceTransformer(d_model={task.d_model}, n_layer={task.n_layer}, n_head=4, "
        f"n_kv_head=2, d_ff={2 * task.d_model})`, batch {task.batch_size}, 10 warmup steps "
        f"then constant lr, budget {task.max_steps} steps. Muon's AdamW branch uses AdamW's "
        "tuned lr; the Muon lr is `muon_lr` with `muon_lr_scale: rms`."
    )


def _sweep_rows(comparison: Comparison) -> list[str]:
    rows = [
        "| optimizer | swept | value → steps to the headline target (`-`: not reached) |",
        "|---|---|---|",
    ]
    for label, results in comparison.sweep.items():
        cells = ", ".join(
            f"{value:g} → {r.steps if r.steps is not None else '-'}" for value, r in results
        )
        rows.append(f"| {label} | {'lr' if label == 'AdamW' else 'muon_lr'} | {cells} |")
    return rows


def _tuned_rows(comparison: Comparison, gaps: Sequence[float], headline: float) -> list[str]:
    header = " | ".join(
        f"floor+{gap:g}" + (" (headline)" if gap == headline else "") for gap in gaps
    )
    rows = [
        f"| optimizer | tuned value | headline steps per seed | {header} | CPU s to headline |",
        "|---|---|---|" + "---|" * len(gaps) + "---|",
    ]
    adamw = {
        gap: _mean_steps([r.steps_to_gap[gap] for r in comparison.runs["AdamW"]]) for gap in gaps
    }
    for label, results in comparison.runs.items():
        per_seed = ", ".join(str(r.steps) if r.steps is not None else "-" for r in results)
        cells = []
        for gap in gaps:
            mean = _mean_steps([r.steps_to_gap[gap] for r in results])
            base = adamw[gap]
            if mean is None:
                cells.append("-")
            elif label == "AdamW" or base is None:
                cells.append(f"{mean:.1f}")
            else:
                cells.append(f"{mean:.1f} ({mean / base:.2f}×)")
        seconds = _mean([r.seconds for r in results])
        rows.append(
            f"| {label} | {comparison.best[label]:g} | {per_seed} | {' | '.join(cells)} "
            f"| {seconds:.2f} |"
        )
    return rows


def _verdict(comparison: Comparison, goal: float = 0.8) -> str:
    adamw = _mean_steps([r.steps for r in comparison.runs["AdamW"]])
    parts = []
    for label in ("Muon", "Muon+cautious"):
        mine = _mean_steps([r.steps for r in comparison.runs.get(label, [])])
        if adamw is None or mine is None:
            parts.append(f"{label}: not comparable (a run missed the headline target)")
            continue
        ratio = mine / adamw
        verdict = "meets" if ratio <= goal else "misses"
        parts.append(f"{label} needs {ratio:.3f}× AdamW's steps ({verdict} the ≤ {goal}× goal)")
    return "Headline: " + "; ".join(parts) + "."


def report(problem: Problem, comparison: Comparison, step_rows: list[str], elapsed: float) -> str:
    seeds = ", ".join(map(str, comparison.seeds))
    cpu = torch.device("cpu")
    small, large = (ns_work_dtype(cpu, torch.float32, (n, n)) for n in (64, CPU_BF16_MIN_SIDE))
    precision = f"{_short(small)} below {CPU_BF16_MIN_SIDE} rows/cols, {_short(large)} from there"
    return "\n".join(
        [
            _task_text(problem),
            "",
            "Learning-rate sweep (seed 0):",
            "",
            *_sweep_rows(comparison),
            "",
            f"Tuned settings, seeds {seeds} run interleaved; mean steps to each target "
            "(ratio to AdamW):",
            "",
            *_tuned_rows(comparison, problem.gaps, problem.task.target_gap),
            "",
            _verdict(comparison),
            "",
            f"Muon optimizer step time (median CPU time, 1 thread; `ns_dtype: auto` here: "
            f"{precision}):",
            "",
            *step_rows,
            "",
            f"Machine: {platform.machine()} `{_cpu_name()}`, torch {torch.__version__}, "
            f"1 thread; benchmark wall time {elapsed:.0f} s.",
        ]
    )


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def write_docs(text: str, path: Path = DOC) -> None:
    content = path.read_text(encoding="utf-8")
    if START_MARK not in content or END_MARK not in content:
        raise SystemExit(f"{path} has no {START_MARK} ... {END_MARK} section")
    head, rest = content.split(START_MARK, 1)
    _, tail = rest.split(END_MARK, 1)
    path.write_text(f"{head}{START_MARK}\n{text}\n{END_MARK}{tail}", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--seeds", type=int, default=5, help="seeds for the tuned comparison")
    parser.add_argument("--write-docs", action="store_true", help=f"update {DOC.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    began = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - began:6.1f}s] {message}", file=sys.stderr, flush=True)

    task = Task(max_steps=40, eval_every=10, target_gap=1.0) if args.quick else Task()
    problem = Problem(task)
    log(f"target loss {problem.target:.3f} (floor {problem.floor:.3f})")
    comparison = compare(
        problem, families(args.quick), range(1, 1 + (1 if args.quick else args.seeds)), log
    )
    step_rows = step_time_table(
        (64,) if args.quick else (64, 128, 256), 3 if args.quick else 10, log
    )
    text = report(problem, comparison, step_rows, time.perf_counter() - began)
    print(text)
    if args.write_docs:
        write_docs(text)
        log(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
