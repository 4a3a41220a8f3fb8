"""Every CUDA path of speedtronic, checked in one run on one GPU (a few minutes at most).

Each check trains a tiny model through the real composition path (``prepared_fit``, the
same one ``speedtronic fit`` uses) with one CUDA feature switched on, and prints one line:
``ok`` or ``FAILED`` with the error, tokens/s, peak device memory and MFU against the
device's dense 16-bit peak (where ``system_metrics`` knows it). The multi-process checks
(NCCL, DDP, FSDP2) start their ranks with ``torch.distributed.run`` as a user would.

    python benchmarks/gpu_check.py                  # every check, a plain table
    python benchmarks/gpu_check.py --markdown       # the table for docs/performance.md
    python benchmarks/gpu_check.py --only bf16 --only fsdp2

On a machine without CUDA it prints one line saying so and exits 2, having run nothing.
``tests/gpu/`` holds the same checks as pytest tests that skip without CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from speedtronic.engine.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
STEPS = 30
LOG_EVERY = 10


@dataclass(frozen=True)
class Outcome:
    """What one check measured (``None``: not measured by that check)."""

    tokens_per_s: float | None = None
    peak_bytes: int | None = None
    mfu: float | None = None
    note: str = ""


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    seconds: float
    outcome: Outcome = field(default_factory=Outcome)
    error: str = ""


def tiny_config(output_dir: Path, **sections: object) -> dict[str, object]:
    """A reference-transformer run small enough to compile and train in seconds, with the
    system metrics that give tokens/s, peak memory and MFU. ``sections`` replace or extend
    the top-level sections (a mapping is merged into the default section)."""
    config: dict[str, object] = {
        "run": {
            "name": "gpu-check",
            "seed": 0,
            "device": "cuda",
            "max_steps": STEPS,
            "output_dir": str(output_dir),
        },
        "model": {
            "name": "reference_transformer",
            "vocab_size": 512,
            "max_seq_len": 256,
            "n_layer": 4,
            "n_head": 8,
            "n_kv_head": 4,
            "d_model": 256,
            "d_ff": 1024,
        },
        "data": {
            "synthetic": True,
            "synthetic_kind": "learnable",
            "num_tokens": 512 * 256,
            "micro_batch_size": 16,
            "target_batch_size": 32,
        },
        "optimizer": {"name": "adamw", "lr": 1e-3},
        "logging": {"every_steps": LOG_EVERY, "console": False},
        "checkpoint": {"enabled": False},
        "callbacks": [{"name": "system_metrics"}],
    }
    for name, value in sections.items():
        default = config.get(name)
        if isinstance(default, dict) and isinstance(value, Mapping):
            config[name] = {**default, **value}
        else:
            config[name] = value
    return config


def outcome_of_records(records: Sequence[Mapping[str, object]], note: str = "") -> Outcome:
    """The last logged record's throughput, the fit's peak memory and MFU."""
    last = records[-1] if records else {}

    def number(key: str) -> float | None:
        value = last.get(key)
        return float(value) if isinstance(value, int | float) else None

    peak = number("memory_peak_bytes")
    return Outcome(
        tokens_per_s=number("tokens_per_sec"),
        peak_bytes=int(peak) if peak is not None else None,
        mfu=number("mfu"),
        note=note,
    )


@contextlib.contextmanager
def run_directory() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="speedtronic-gpu-check-") as tmp:
        yield Path(tmp) / "run"


def fit_in_process(
    config: Mapping[str, object],
    require_note: str | None = None,
    inspect: Callable[[Trainer], str] | None = None,
) -> Outcome:
    """One fit through ``prepared_fit``. ``require_note``: the trainer note (on
    ``trainer.notes``) that must say ``enabled: true`` -- a feature that quietly fell back
    (``torch.compile`` to eager, stage streams off) fails the check. ``inspect`` looks at the
    trained Trainer and returns a note, or raises when the feature did not run."""
    from speedtronic.runtime import prepared_fit

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    notes: dict[str, dict[str, object]] = {}
    with prepared_fit(dict(config)) as trainer:
        trainer.notes.subscribe(lambda event, payload: notes.__setitem__(event, payload))
        result = trainer.fit()
        inspected = inspect(trainer) if inspect is not None else ""
    if result.final_loss is None or not torch.isfinite(torch.tensor(result.final_loss)):
        raise RuntimeError(f"final loss {result.final_loss}")
    note = ""
    if require_note is not None:
        payload = notes.get(require_note)
        if payload is None or payload.get("enabled") is not True:
            raise RuntimeError(f"{require_note} did not run: {payload}")
        note = f"{require_note}: {payload.get('reason', 'enabled')}"
    return outcome_of_records(result.metrics, "; ".join(filter(None, (note, inspected))))


HF_LLAMA: dict[str, object] = {
    "name": "hf_causal_lm",
    "vocab_size": 512,
    "max_seq_len": 256,
    "options": {
        "config": {
            "model_type": "llama",
            "hidden_size": 256,
            "intermediate_size": 688,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
        }
    },
}
ASYNC_CHECKPOINT: dict[str, object] = {
    "enabled": True,
    "every_steps": 10,
    "async_save": True,
    "keep_last": 2,
}

# The sections each single-process check sets over ``tiny_config``, and the trainer note
# that proves the feature ran. tests/test_gpu_check.py validates every one on the CPU, so
# a mistyped option shows without a GPU.
VARIANTS: dict[str, tuple[dict[str, object], str | None]] = {
    "fp32": ({"precision": "fp32"}, None),
    "bf16": ({"precision": "bf16"}, None),
    "fp16+scaler": ({"precision": "fp16"}, None),
    "fused_adamw": ({"optimizer": {"name": "adamw", "lr": 1e-3, "fused": True}}, None),
    "compile_reference": ({"compile": True, "precision": "bf16"}, "compile"),
    "compile_hf_llama": ({"model": HF_LLAMA, "compile": True, "precision": "bf16"}, "compile"),
    "muon": ({"precision": "bf16", "optimizer": {"name": "muon", "lr": 0.02}}, None),
    "ema": (
        {"precision": "bf16", "callbacks": [{"name": "system_metrics"}, {"name": "ema"}]},
        None,
    ),
    "stage_streams": ({"ooo_backprop": True, "ooo_streams": 2}, "ooo_backprop"),
    "async_checkpoint": ({"checkpoint": ASYNC_CHECKPOINT}, None),
    "ddp_nccl": ({"precision": "bf16"}, None),
    "fsdp2": (
        {
            "precision": "bf16",
            "parallel": {"strategy": "fsdp"},
            "checkpoint": {"enabled": True, "every_steps": STEPS},
        },
        None,
    ),
}


def check_variant(name: str) -> Callable[[], Outcome]:
    sections, require_note = VARIANTS[name]

    def run() -> Outcome:
        if sections.get("model") is HF_LLAMA:
            require_transformers()
        with run_directory() as out:
            return fit_in_process(tiny_config(out, **sections), require_note)

    return run


def require_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise RuntimeError("transformers is not installed (pip install 'speedtronic[hf]')") from exc


def check_fused_adamw() -> Outcome:
    def fused(trainer: Trainer) -> str:
        # torch's AdamW keeps ``fused`` in every param group; None or False means foreach.
        if not all(group.get("fused") is True for group in trainer.param_groups):
            raise RuntimeError("the trainer's AdamW param groups are not fused")
        return "fused param groups"

    sections, _ = VARIANTS["fused_adamw"]
    with run_directory() as out:
        return fit_in_process(tiny_config(out, **sections), inspect=fused)


def check_async_checkpoint() -> Outcome:
    """Async saves snapshot into pinned host buffers; the run then resumes from them."""
    from speedtronic.runtime import train_from_config

    sections, _ = VARIANTS["async_checkpoint"]
    with run_directory() as out:
        outcome = fit_in_process(tiny_config(out, **sections))
        saved = sorted((out / "checkpoints").glob("step_*"))
        if not saved:
            raise RuntimeError("no checkpoint was written")
        resumed = train_from_config(tiny_config(out, **sections), resume=True, max_steps=STEPS + 10)
        if resumed.steps != STEPS + 10:
            raise RuntimeError(f"resume reached step {resumed.steps}, not {STEPS + 10}")
        return Outcome(
            outcome.tokens_per_s, outcome.peak_bytes, outcome.mfu, f"{len(saved)} saved, resumed"
        )


def check_attention_masks() -> Outcome:
    """SDPA with a block-causal boolean mask against the math kernel, and flex_attention
    with the same mask as a block mask (compiled, as it runs in training)."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    torch.manual_seed(0)
    batch, heads, seq, dim = 2, 8, 256, 64
    q, k, v = (
        torch.randn(batch, heads, seq, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    document = torch.arange(seq, device="cuda") // 64  # four documents of 64 tokens
    position = torch.arange(seq, device="cuda")
    mask = (document[:, None] == document[None, :]) & (position[:, None] >= position[None, :])
    expected = sdpa(q.float(), k.float(), v.float(), attn_mask=mask)
    fused = sdpa(q, k, v, attn_mask=mask)
    error = (fused.float() - expected).abs().max().item()
    if error > 2e-2:
        raise RuntimeError(f"SDPA with a mask differs from fp32 math by {error:.3g}")
    notes = [f"sdpa max err {error:.1e}"]
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        notes.append("flex_attention unavailable in this torch")
        return Outcome(note="; ".join(notes))

    def block_causal(
        b: object, h: object, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        return (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)

    block_mask = create_block_mask(block_causal, None, None, seq, seq, device="cuda")
    flex = torch.compile(flex_attention)(q, k, v, block_mask=block_mask)
    flex_error = (flex.float() - expected).abs().max().item()
    if flex_error > 2e-2:
        raise RuntimeError(f"flex_attention differs from fp32 math by {flex_error:.3g}")
    notes.append(f"flex max err {flex_error:.1e}")
    notes.append(f"model flex/sdpa max grad diff {_document_attention_difference():.1e}")
    return Outcome(peak_bytes=torch.cuda.max_memory_allocated(), note="; ".join(notes))


def _document_attention_difference() -> float:
    """The reference transformer trained one step on packed documents with
    ``document_attention`` flex and sdpa: the largest difference of the loss and gradients
    (an error above fp32 tolerance)."""
    from speedtronic.data.documents import document_positions
    from speedtronic.models.transformer import ReferenceTransformer

    ids = torch.randint(1, 256, (4, 512), generator=torch.Generator().manual_seed(0))
    ids[:, ::97] = 0  # an end-of-document id every 97 tokens
    positions = document_positions(ids, 0).cuda()
    ids = ids.cuda()
    found: dict[str, list[torch.Tensor]] = {}
    for kernel in ("sdpa", "flex"):
        torch.manual_seed(0)
        model = ReferenceTransformer(
            vocab_size=256, max_seq_len=512, n_layer=2, n_head=4, d_model=128,
            document_attention=kernel,
        ).cuda()  # fmt: skip
        loss = model(ids, labels=ids, position_ids=positions)["loss"]
        loss.backward()
        found[kernel] = [loss.detach(), *(p.grad for p in model.parameters() if p.grad is not None)]
    worst = max(
        float((a - b).abs().max()) for a, b in zip(found["sdpa"], found["flex"], strict=True)
    )
    if worst > 1e-3:
        raise RuntimeError(f"document_attention flex differs from sdpa by {worst:.3g}")
    return worst


def run_ranks(sections: Mapping[str, object], nproc: int) -> Outcome:
    """``speedtronic fit`` under ``torch.distributed.run`` (NCCL on CUDA), its records read
    back from the run's ``metrics.jsonl``."""
    with run_directory() as out:
        out.parent.mkdir(parents=True, exist_ok=True)
        config_path = out.parent / "run.json"
        logging = {"every_steps": LOG_EVERY, "console": False, "jsonl": True}
        config_path.write_text(json.dumps(tiny_config(out, **{**sections, "logging": logging})))
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "speedtronic",
            "fit",
            "--config",
            str(config_path),
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=REPO)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"exit {done.returncode}: {' | '.join(tail)}")
        metrics = out / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        return outcome_of_records(records, f"{nproc} rank(s), NCCL")


def ranks_for_check() -> int:
    return max(1, min(2, torch.cuda.device_count()))


def check_generate() -> Outcome:
    """KV-cache decoding on the GPU (the lean one-token step): greedy tokens equal
    recomputing the prefix, and no host read per token."""
    from speedtronic.models.generation import Sampling, generate_ids
    from speedtronic.models.transformer import ReferenceTransformer

    torch.manual_seed(0)
    net = ReferenceTransformer(
        vocab_size=257, block_size=160, n_layer=2, n_head=4, n_kv_head=2, d_model=64
    ).to("cuda")
    greedy = Sampling(max_new_tokens=128, temperature=0.0)
    prompt = list(range(8))
    generate_ids(net, prompt, greedy)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    cached = generate_ids(net, prompt, greedy)
    elapsed = time.perf_counter() - start
    if cached != generate_ids(net, prompt, greedy, use_cache=False):
        raise RuntimeError("greedy tokens with the KV cache differ from recomputing the prefix")
    note = f"{elapsed / len(cached) * 1e3:.3f} ms/token, cache == recompute"
    return Outcome(len(cached) / elapsed, torch.cuda.max_memory_allocated(), None, note)


def check_ranks(name: str) -> Callable[[], Outcome]:
    sections, _ = VARIANTS[name]

    def run() -> Outcome:
        return run_ranks(sections, ranks_for_check())

    return run


CHECKS: dict[str, Callable[[], Outcome]] = {
    **{name: check_variant(name) for name in ("fp32", "bf16", "fp16+scaler")},
    "fused_adamw": check_fused_adamw,
    **{name: check_variant(name) for name in ("compile_reference", "compile_hf_llama")},
    **{name: check_variant(name) for name in ("muon", "ema", "stage_streams")},
    "async_checkpoint": check_async_checkpoint,
    "attention_masks": check_attention_masks,
    "generate_kv_cache": check_generate,
    "ddp_nccl": check_ranks("ddp_nccl"),
    "fsdp2": check_ranks("fsdp2"),
}


def run_check(name: str, check: Callable[[], Outcome]) -> CheckResult:
    start = time.perf_counter()
    try:
        outcome = check()
    except Exception as exc:  # noqa: BLE001 -- one failed path must not hide the others
        last = traceback.extract_tb(exc.__traceback__)[-1:]
        where = f" ({Path(last[0].filename).name}:{last[0].lineno})" if last else ""
        message = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return CheckResult(name, False, time.perf_counter() - start, error=message + where)
    finally:
        torch.cuda.empty_cache()
    return CheckResult(name, True, time.perf_counter() - start, outcome)


def format_row(result: CheckResult) -> list[str]:
    outcome = result.outcome
    tokens = f"{outcome.tokens_per_s:,.0f}" if outcome.tokens_per_s is not None else "-"
    peak = f"{outcome.peak_bytes / 2**20:,.0f}" if outcome.peak_bytes is not None else "-"
    mfu = f"{100 * outcome.mfu:.1f}%" if outcome.mfu is not None else "-"
    status = "ok" if result.ok else "FAILED"
    detail = outcome.note if result.ok else result.error
    return [result.name, status, tokens, peak, mfu, f"{result.seconds:.1f}", detail]


HEADER = ["path", "status", "tokens/s", "peak MiB", "MFU", "s", "note / error"]


def print_table(results: Sequence[CheckResult], markdown: bool) -> None:
    rows = [format_row(result) for result in results]
    if markdown:
        print("| " + " | ".join(HEADER) + " |")
        print("|" + "---|" * len(HEADER))
        for row in rows:
            print("| " + " | ".join(cell.replace("|", "/") for cell in row) + " |")
        return
    widths = [max(len(row[i]) for row in [HEADER, *rows]) for i in range(len(HEADER) - 1)]
    for row in [HEADER, *rows]:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))
            + "  "
            + row[-1]
        )


def describe_device() -> str:
    props = torch.cuda.get_device_properties(0)
    return (
        f"{props.name}, {props.total_memory / 2**30:.0f} GiB, "
        f"{torch.cuda.device_count()} device(s), "
        f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--only", action="append", choices=sorted(CHECKS), help="run this check")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here (torch.cuda.is_available() is False); nothing was run"
        )
        return 2
    os.environ.setdefault("WANDB_MODE", "offline")
    sys.path.insert(0, str(REPO))
    print(f"gpu_check: {describe_device()}", flush=True)
    results = []
    for name in args.only or list(CHECKS):
        result = run_check(name, CHECKS[name])
        print(f"  {name}: {'ok' if result.ok else 'FAILED'} ({result.seconds:.1f} s)", flush=True)
        results.append(result)
    print_table(results, args.markdown)
    return 0 if all(result.ok for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
