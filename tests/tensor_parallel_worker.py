"""The rank side of tests/test_tensor_parallel.py: tiny models trained under
``parallel: {strategy: fsdp, tensor: T}`` on real gloo processes, results written to files.

The data is fixed by a seed, as a *global* batch per step: data rank ``d`` of ``D`` takes rows
``d*B/D .. (d+1)*B/D`` of it, the same rows on every tensor rank of its group, so every
layout trains on exactly the batches of the one-process run.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

import torch
from rank_env import rank_env
from torch import nn

STEPS = 20
ACCUMULATION_STEPS = (2, 6)
TIED_STEPS = 8
"""(microbatches per step, steps) of the accumulation case."""
GLOBAL_BATCH = 4
SEQ = 8
VOCAB = 32

LLAMA: dict[str, object] = {
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16,
}
"""A two-layer GQA Llama (heads 4, kv heads 2, MLP 48: all divisible by 2)."""


def build_model(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family == "reference":
        from speedtronic.models.transformer import ReferenceTransformer

        return ReferenceTransformer(
            vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32
        )
    from speedtronic.models.hf import build_hf_causal_lm

    tied = {"tie_word_embeddings": family == "llama_tied"}  # one embedding and head matrix
    return build_hf_causal_lm(config={**LLAMA, **tied}, vocab_size=VOCAB, block_size=16)


def batches(data_rank: int, data_ranks: int, steps: int = STEPS) -> list[dict[str, torch.Tensor]]:
    shape = (steps, GLOBAL_BATCH, SEQ + 1)
    tokens = torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(7))
    rows = GLOBAL_BATCH // data_ranks
    own = tokens[:, data_rank * rows : (data_rank + 1) * rows]
    return [{"input_ids": t[:, :-1], "labels": t[:, 1:]} for t in own]


def make_trainer(
    family: str,
    *,
    tensor: int,
    rank: int = 0,
    world: int = 1,
    distributed: object = None,
    directory: Path | None = None,
    every: int = 5,
    steps: int = STEPS,
    accumulation: int = 1,
) -> object:
    from speedtronic import Trainer
    from speedtronic_callbacks.checkpoint import CheckpointCallback

    model = build_model(family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    callbacks = (
        [CheckpointCallback(directory, every_steps=every, save_on_signal=False)]
        if directory is not None
        else []
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Trainer(
            model,
            optimizer,
            # this rank's data rank's rows
            batches(rank // tensor, world // tensor, steps * accumulation),
            device="cpu",
            distributed=distributed,  # type: ignore[arg-type]  # a DistributedContext
            parallel={"strategy": "fsdp", "tensor": tensor},
            callbacks=callbacks,
            grad_clip=0.5,  # clipping is active: the global norm over DTensors is used
            accumulation_steps=accumulation,
            metrics_every=1,
        )


def full_state(trainer: object) -> dict[str, torch.Tensor]:
    """Weights and AdamW moments as whole tensors (gathered from DTensors)."""
    from torch.distributed.tensor import DTensor

    def whole(value: torch.Tensor) -> torch.Tensor:
        return (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()

    model: nn.Module = trainer.model  # type: ignore[attr-defined]
    optimizer: torch.optim.Optimizer = trainer.optimizer  # type: ignore[attr-defined]
    out = {f"w/{k}": whole(v) for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for param, state in optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}/{names[id(param)]}"] = whole(state[key])
    return out


def fit(trainer: object, steps: int) -> dict[str, list[float]]:
    """The logged (global) losses, grad norms, sample and token counts of each step, and
    the fit's run totals (``totals``: samples, tokens)."""
    result = trainer.fit(steps)  # type: ignore[attr-defined]
    keys = ("loss", "grad_norm", "samples", "tokens")
    logged = {key: [float(record[key]) for record in result.metrics] for key in keys}
    return {**logged, "totals": [float(result.samples), float(result.tokens)]}


def resume(trainer: object) -> str:
    from speedtronic.state.resume import resume_from

    callback = trainer.callbacks[0]  # type: ignore[attr-defined]
    return str(resume_from(trainer, callback.manager))  # type: ignore[arg-type]


def relayout(
    family: str, old: int, new: int, world: int, rank: int, context: object, root: Path
) -> tuple[dict[str, object], dict[str, dict[str, torch.Tensor]]]:
    """5 steps at tensor degree ``old``, checkpointed; a trainer at degree ``new`` resumes it
    and trains to step 7. Returns (report, {saved, loaded} whole states)."""
    directory = root / f"{family}-t{old}-to-t{new}"
    place = {"rank": rank, "world": world, "distributed": context, "directory": directory}
    first = make_trainer(family, tensor=old, **place)  # type: ignore[arg-type]
    first.fit(5)  # type: ignore[attr-defined]
    saved = full_state(first)
    second = make_trainer(family, tensor=new, **place)  # type: ignore[arg-type]
    report: dict[str, object] = {"from": resume(second), "step": second.step}  # type: ignore[attr-defined]
    loaded = full_state(second)
    after = fit(second, 7)
    report["after"] = after["loss"]
    report["counted"] = {key: after[key] for key in ("samples", "tokens", "totals")}
    return report, {"saved": saved, "loaded": loaded}


def rank_main(rank: int, world: int, port: int, out: str) -> None:
    """One rank of a ``world``-rank job (tensor degree 2): every scenario, results to files."""
    os.environ.update(rank_env(rank, world, port))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    from torch.distributed.tensor import DTensor

    from speedtronic.systems.distributed import setup_distributed, teardown_distributed

    context = setup_distributed("cpu", timeout_s=300.0)
    assert context is not None
    root = Path(out)
    report: dict[str, object] = {}
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    try:
        for family in ("reference", "llama"):
            trainer = make_trainer(
                family,
                tensor=2,
                rank=rank,
                world=world,
                distributed=context,
            )
            report[family] = fit(trainer, STEPS)
            params = dict(trainer.model.named_parameters())  # type: ignore[attr-defined]
            report[f"{family}/on_2d_mesh"] = all(
                isinstance(p, DTensor) and p.device_mesh.ndim == 2 for p in params.values()
            )
            report[f"{family}/local_numel"] = sum(
                p.to_local().numel() for p in params.values() if isinstance(p, DTensor)
            )
        if world == 4:  # accumulation: no reduce-scatter over the data ranks but on the last
            trainer = make_trainer(
                "reference",
                tensor=2,
                rank=rank,
                world=world,
                distributed=context,
                accumulation=ACCUMULATION_STEPS[0],
                steps=ACCUMULATION_STEPS[1],
            )
            report["reference/k2"] = fit(trainer, ACCUMULATION_STEPS[1])
        if world == 2:  # sequence parallelism: a length T does not divide is refused
            trainer = make_trainer(
                "reference", tensor=2, rank=rank, world=world, distributed=context
            )
            try:
                trainer.model(torch.zeros(1, SEQ - 1, dtype=torch.long))  # type: ignore[attr-defined]
            except ValueError as exc:
                report["odd_sequence"] = str(exc)
        if world == 2:  # a tied embedding and head stay one parameter, split by vocabulary
            trainer = make_trainer(
                "llama_tied", tensor=2, rank=rank, world=world, distributed=context
            )
            hf = trainer.model.hf  # type: ignore[attr-defined]
            report["llama_tied/tied"] = hf.lm_head.weight is hf.model.embed_tokens.weight
            report["llama_tied"] = fit(trainer, TIED_STEPS)
        if world == 2:  # tensor 2 x data 1 -> data 2 (tensor 1), and back
            for family, old, new in (("reference", 2, 1), ("reference", 1, 2), ("llama", 2, 1)):
                key = f"{family}/t{old}->t{new}"
                report[key], tensors[key] = relayout(family, old, new, world, rank, context, root)
    finally:
        teardown_distributed(context)
    if rank == 0:
        torch.save(tensors, root / f"w{world}.pt")
    (root / f"w{world}-rank{rank}.json").write_text(json.dumps(report))


def cli_rank(argv: list[str]) -> int:
    """One rank of a CLI run (the torchrun variables come with the forked child's env)."""
    from speedtronic.cli import main

    return main(argv)


def local_parameter_styles_rank() -> int:
    """One gloo rank (a tensor mesh of 1): a norm under ``ReplicateParallel`` and under
    ``LocalSequenceParallel`` computes what the plain norm does, on plain tensors, and its
    parameters are the same DTensor objects again after a forward -- also after one that
    raised -- with the gradient on them in the style's placement. Exit code 0 when all hold."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor.parallel import parallelize_module

    from speedtronic.models.transformer import RMSNorm
    from speedtronic.systems.tensor_parallel_plans import LocalSequenceParallel, ReplicateParallel

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1,))
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0))
    for style, placement in ((ReplicateParallel, Replicate()), (LocalSequenceParallel, Partial())):
        torch.manual_seed(0)
        plain, split = RMSNorm(8), RMSNorm(8)
        with torch.no_grad():
            plain.weight.uniform_(0.5, 1.5)
            split.weight.copy_(plain.weight)
        parallelize_module(split, mesh, style())
        weight = split.weight
        assert isinstance(weight, DTensor) and weight.placements == (Replicate(),)
        out = split(x)
        assert not isinstance(out, DTensor) and split.weight is weight
        torch.testing.assert_close(out, plain(x), rtol=0, atol=0)
        out.square().sum().backward()
        plain(x).square().sum().backward()
        grad = weight.grad
        assert isinstance(grad, DTensor) and grad.placements == (placement,), grad
        assert plain.weight.grad is not None
        torch.testing.assert_close(grad.to_local(), plain.weight.grad, rtol=0, atol=0)
        try:
            split(torch.randn(2, 3))  # the wrong width: the norm's multiply raises
        except RuntimeError:
            pass
        assert split.weight is weight and isinstance(split._parameters["weight"], DTensor)
    dist.destroy_process_group()
    return 0
