"""The ``profiler`` callback: a trace of the window's active steps that parses as a Chrome
trace and names the operators, a one-line summary, hooks called on the window's steps only,
the rank filter, a fit ending inside the window, and bad options (exit 2)."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from cli_runner import run_cli
from scalar_model import Scalar
from torch import nn

from speedtronic import Trainer
from speedtronic.engine.contexts import StepContext
from speedtronic.engine.dispatch import CallbackWarning
from speedtronic.engine.view import TrainerView
from speedtronic_callbacks.profiler import Profiler
from speedtronic_callbacks.profiler_summary import OperatorTime, read_trace_events, top_operators

torch.set_num_threads(1)


class Watched(Profiler):
    """The profiler, recording the steps its per-step hooks are called on."""

    def __init__(self, **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]  # the options of Profiler
        self.started: list[int] = []
        self.ended: list[int] = []

    def on_step_start(self, trainer: TrainerView, ctx: StepContext) -> None:
        self.started.append(ctx.step)
        super().on_step_start(trainer, ctx)

    def on_step_end(self, trainer: TrainerView, ctx: StepContext) -> None:
        self.ended.append(ctx.step)
        super().on_step_end(trainer, ctx)


def fit(
    profiler: Profiler, tmp_path: Path, steps: int = 9, model: nn.Module | None = None
) -> Trainer:
    model = model if model is not None else Scalar()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        [(torch.ones(4), torch.full((4,), float(i))) for i in range(3)],
        callbacks=[profiler],
        max_steps=steps,
        output_dir=tmp_path,
    )
    trainer.fit()
    return trainer


def trace_events(path: Path) -> list[dict[str, object]]:
    trace = json.loads(path.read_text(encoding="utf-8"))
    events = trace["traceEvents"]
    assert isinstance(events, list)
    return events


def step_spans(path: Path) -> list[str]:
    names = {str(e.get("name")) for e in trace_events(path)}
    return sorted(name for name in names if name.startswith("ProfilerStep#"))


def test_a_window_is_traced_summarised_and_nothing_outside_it_is_called(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profiler = Watched(start_step=3, wait=1, warmup=1, active=2)
    fit(profiler, tmp_path)
    # The loop calls the profiler on the window's steps only (3..6), not before or after.
    assert profiler.started == [3]
    assert profiler.ended == [3, 4, 5, 6]
    (trace,) = profiler.traces
    assert trace.parent == tmp_path / "profiler"
    assert trace.name.startswith("rank0.") and trace.name.endswith(".pt.trace.json")
    names = {str(e.get("name")) for e in trace_events(trace)}
    assert "aten::mul" in names and "aten::mean" in names  # the model's operators
    # Only the active steps are in it: the window's steps 2 and 3, global steps 5 and 6.
    assert step_spans(trace) == ["ProfilerStep#2", "ProfilerStep#3"]
    (line,) = profiler.summaries
    assert line.startswith(f"profiler: rank 0 steps 5-6 -> {trace} | top self CPU (of ")
    top = line.split("): ", 1)[1].split(", ")
    assert len(top) == 5 and all(" ms (" in part for part in top)
    assert "ProfilerStep" not in line  # steps are not operators
    assert line in capsys.readouterr().out


def test_each_cycle_writes_a_trace_and_a_line(tmp_path: Path) -> None:
    profiler = Watched(start_step=1, wait=0, warmup=1, active=1, repeat=2, top=2)
    fit(profiler, tmp_path, steps=6)
    assert profiler.ended == [1, 2, 3, 4]
    assert [step_spans(t) for t in profiler.traces] == [["ProfilerStep#1"], ["ProfilerStep#3"]]
    assert [line.split(" -> ")[0] for line in profiler.summaries] == [
        "profiler: rank 0 steps 2-2",
        "profiler: rank 0 steps 4-4",
    ]


def test_a_fit_that_ends_inside_the_window_writes_what_it_recorded(tmp_path: Path) -> None:
    profiler = Watched(start_step=2, wait=0, warmup=1, active=5)
    fit(profiler, tmp_path, steps=4)
    (trace,) = profiler.traces
    # Steps 3 and 4 (2 was the warm-up), and the span the profiler opened for a step 5
    # that never came.
    assert step_spans(trace) == ["ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]
    assert profiler.summaries[0].startswith("profiler: rank 0 steps 3-4 -> ")


def test_only_the_chosen_ranks_profile(tmp_path: Path) -> None:
    elsewhere = Watched(start_step=1, wait=0, warmup=1, active=1, ranks=[1])
    fit(elsewhere, tmp_path, steps=3)
    assert elsewhere.ended == [1, 2]  # due, but rank 0 is not one of its ranks
    assert elsewhere.traces == [] and not (tmp_path / "profiler").exists()
    everywhere = Watched(start_step=1, wait=0, warmup=1, active=1, ranks="all")
    fit(everywhere, tmp_path, steps=3)
    assert len(everywhere.traces) == 1


def test_a_trace_that_cannot_be_written_is_reported_once_and_training_goes_on(
    tmp_path: Path,
) -> None:
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the trace directory should be")
    profiler = Watched(start_step=1, wait=0, warmup=1, active=1, repeat=2, dir=blocked)
    with pytest.warns(CallbackWarning, match="profiler") as caught:
        trainer = fit(profiler, tmp_path, steps=6)
    assert trainer.step == 6 and profiler.traces == []
    assert len([w for w in caught if issubclass(w.category, CallbackWarning)]) == 1
    assert not torch.autograd.profiler._is_profiler_enabled  # stopped, not left running
    assert profiler.summaries == []  # and no second cycle was recorded


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"active": 0}, "profiler: active must be an integer >= 1, got 0"),
        ({"wait": -1}, "profiler: wait must be an integer >= 0, got -1"),
        ({"start_step": 0}, "profiler: start_step must be an integer >= 1, got 0"),
        ({"ranks": []}, "profiler: ranks must be 'all' or a list of ranks, got []"),
    ],
)
def test_bad_window_options_are_refused(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        Profiler(**options)  # type: ignore[arg-type]  # deliberately wrong values
    assert str(caught.value) == message


def run_yaml(tmp_path: Path, entry: dict[str, object]) -> Path:
    config = {
        "run": {"device": "cpu", "max_steps": 4, "output_dir": str(tmp_path / "run")},
        "model": {
            "name": "reference_transformer",
            "vocab_size": 32,
            "max_seq_len": 8,
            **{"n_layer": 1, "n_head": 2, "n_kv_head": 1, "d_model": 16, "d_ff": 32},
        },
        "data": {"synthetic_kind": "learnable", "num_tokens": 128, "micro_batch_size": 4},
        "logging": {"console": False, "jsonl": False},
        "checkpoint": {"enabled": False},
        "callbacks": [{"name": "profiler", **entry}],
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def test_a_cli_run_writes_its_trace_into_the_run_directory(tmp_path: Path) -> None:
    config = run_yaml(tmp_path, {"start_step": 2, "wait": 0, "warmup": 1, "active": 1})
    result = run_cli("fit", "--config", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (trace,) = (tmp_path / "run" / "profiler").glob("rank0.*.pt.trace.json")
    names = {str(e.get("name")) for e in trace_events(trace)}
    assert "aten::mm" in names or "aten::addmm" in names  # the transformer's matmuls
    lines = [line for line in result.stdout.splitlines() if line.startswith("profiler: ")]
    assert lines == [lines[0]] and f"steps 3-3 -> {trace} | top self CPU" in lines[0]


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        ({"active": 0}, "callbacks[0].active: 0 is less than the minimum of 1"),
        ({"wait": -2}, "callbacks[0].wait: -2 is less than the minimum of 0"),
        ({"ranks": "some"}, "callbacks[0].ranks: 'some' does not match '^all$'"),
        ({"ranks": [-1]}, "callbacks[0].ranks[0]: -1 is less than the minimum of 0"),
    ],
)
@pytest.mark.parametrize("command", ["validate", "fit"])
def test_bad_options_exit_2_naming_the_key(
    tmp_path: Path, command: str, entry: dict[str, object], error: str
) -> None:
    config = run_yaml(tmp_path, entry)
    result = run_cli(command, "--config", str(config), cwd=tmp_path)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [f"speedtronic: error: invalid configuration in {config}: {error}"]
    assert not (tmp_path / "run").exists()


class Churning(nn.Module):
    """``Scalar``'s loss through a function made and dropped each step, with a non-ASCII
    name; the memory its name held is then overwritten. torch's Python tracer
    (``with_stack``) kept a pointer to that name: ``key_averages()`` decoded garbage."""

    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.zeros(()))
        self.calls = 0
        self.spray: list[bytes] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for _ in range(20):
            self.calls += 1
            name = f"é_{self.calls}_" + "q" * 300
            source = f"def fn_é{self.calls}_{'z' * 200}(a):\n    return a * 2\n"
            namespace: dict[str, object] = {}
            exec(compile(source, f"/generated/{name}.py", "exec"), namespace)
            made = next(v for k, v in namespace.items() if k.startswith("fn_"))
            x = made(x) / 2  # type: ignore[operator]  # the function just made
            del namespace, made
        self.spray = [b"\xff" * size for size in range(100, 700) for _ in range(20)]
        return ((self.v * x - y) ** 2).mean()


def shares(line: str) -> list[int]:
    return [int(share) for share in re.findall(r"\((\d+)%\)", line)]


def test_with_stack_the_summary_survives_and_its_shares_add_up(tmp_path: Path) -> None:
    # Issue 30: with with_stack, a UnicodeDecodeError at teardown lost the summary, and
    # shares over 100% were printed (Python frames' negative self times in the total).
    profiler = Profiler(start_step=2, wait=0, warmup=1, active=5, with_stack=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(profiler, tmp_path, steps=4, model=Churning())  # ends inside the window
    assert not [w for w in caught if issubclass(w.category, CallbackWarning)], [
        str(w.message) for w in caught
    ]
    (line,) = profiler.summaries
    assert line.startswith("profiler: rank 0 steps 3-4 -> ") and "aten::" in line
    assert "generated" not in line and "ProfilerStep" not in line  # operators only
    assert all(share <= 100 for share in shares(line))
    assert sum(shares(line)) <= 100 + len(shares(line))  # each share rounds by < 1%


def span(cat: str, name: str, ts: float, dur: float, **args: object) -> dict[str, object]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur,
            "args": args}  # fmt: skip


def test_operator_self_times_and_device_time_come_from_the_trace(tmp_path: Path) -> None:
    events = [
        span("user_annotation", "ProfilerStep#1", 0, 100),
        span("python_function", "model.py(3): forward", 0, 100),
        span("python_function", "model.py(9): inner", 5, 200),  # another clock: overlaps
        span("cpu_op", "aten::linear", 10, 50, **{"External id": 6}),
        span("cpu_op", "aten::mm", 15, 30, **{"External id": 7}),  # inside linear
        span("cpu_op", "aten::add", 70, 10, **{"External id": 8}),
        {**span("cpu_op", "aten::mm", 0, 20), "tid": 2},  # another thread
        span("kernel", "sgemm_128x64", 20, 40, **{"External id": 7}),
        span("kernel", "orphan_kernel", 70, 5, **{"External id": 99}),
        span("gpu_memcpy", "Memcpy HtoD", 80, 3),
    ]
    top, total = top_operators(events, device=False, count=2)
    assert top == [OperatorTime("aten::mm", 50.0), OperatorTime("aten::linear", 20.0)]
    assert total == 80.0  # linear 20 + mm 30 + add 10 + mm 20: time inside operators
    top, total = top_operators(events, device=True, count=5)
    assert [(op.name, op.self_us) for op in top] == [
        ("aten::mm", 40.0),  # the kernel charged to the operator that launched it
        ("orphan_kernel", 5.0),
        ("Memcpy HtoD", 3.0),
    ]
    assert total == 48.0
    trace = tmp_path / "trace.json"
    text = json.dumps({"traceEvents": events}).replace("inner", "in\\u00e9r")
    trace.write_bytes(text.encode().replace(b"\\u00e9", b"\xff"))  # a byte that is not UTF-8
    assert len(read_trace_events(trace)) == len(events)


def test_a_cli_run_with_stack_prints_shares_that_add_up(tmp_path: Path) -> None:
    # Issue 30: with with_stack, Python frames' self times entered the total and a tiny
    # transformer's run printed `run_backward ... (106%)` and shares summing far past 100%.
    entry = {"start_step": 2, "wait": 0, "warmup": 1, "active": 1, "with_stack": True}
    result = run_cli("fit", "--config", str(run_yaml(tmp_path, entry)), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("profiler: ")]
    found = shares(line)
    names = re.findall(r"(?:: |, )(\S+(?: \S+)*?) [\d.]+ ms \(", line)
    # operators only: no Python frame (``file.py(12): f``) and no annotation (``ProfilerStep#3``);
    # which operators lead varies with the machine's load (autograd's own ones may)
    assert len(found) == 5 and not [name for name in names if ".py(" in name or "#" in name]
    assert sum(found) <= 100 + len(found), line  # each share rounds by < 1%
