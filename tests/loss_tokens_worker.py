"""One training step on fixed, unevenly masked batches; the gradients it took.

``tests/test_loss_tokens.py`` runs ``one_step`` in-process (one rank) and, forked from the
preloaded fork server, on two real ranks over gloo with the torchrun variables set.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from speedtronic.engine.callback import Callback  # noqa: E402
from speedtronic.engine.contexts import OptimizerStepContext  # noqa: E402
from speedtronic.engine.settings import TrainerSettings  # noqa: E402
from speedtronic.engine.trainer import Trainer  # noqa: E402
from speedtronic.models.transformer import ReferenceTransformer  # noqa: E402
from speedtronic.systems.distributed import setup_distributed, teardown_distributed  # noqa: E402

SEQUENCES, LENGTH, VOCAB = 8, 12, 24
LOSS_TOKENS = (1, 12, 0, 7, 2, 12, 3, 11)
"""Loss-bearing labels per sequence: very different counts (one has none)."""


def model() -> ReferenceTransformer:
    torch.manual_seed(0)
    return ReferenceTransformer(
        vocab_size=VOCAB, max_seq_len=LENGTH, n_layer=1, n_head=2, d_model=16, d_ff=32
    )


def global_batch() -> dict[str, torch.Tensor]:
    """Eight sequences; sequence ``i`` has ``LOSS_TOKENS[i]`` labels not ``-100``."""
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, VOCAB, (SEQUENCES, LENGTH), generator=generator)
    labels = torch.randint(0, VOCAB, (SEQUENCES, LENGTH), generator=generator)
    for row, count in enumerate(LOSS_TOKENS):
        labels[row, : LENGTH - count] = -100
    return {"input_ids": inputs, "labels": labels}


class _Grads(Callback):
    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer: object, ctx: OptimizerStepContext) -> None:
        module = getattr(trainer, "model")  # noqa: B009
        assert isinstance(module, torch.nn.Module)
        self.grads = {
            name: param.grad.detach().clone()
            for name, param in module.named_parameters()
            if param.grad is not None
        }


def one_step(out: str, accumulation: int) -> int:
    """One optimizer step over this rank's share of ``global_batch`` in ``accumulation``
    microbatches; the gradients (and the reported loss) go to ``out/rank<r>.pt``."""
    torch.set_num_threads(1)
    distributed = setup_distributed("cpu", timeout_s=30.0)
    rank = 0 if distributed is None else distributed.rank
    world = 1 if distributed is None else distributed.world_size
    batch = global_batch()
    share = SEQUENCES // world
    mine = {key: value[rank * share : (rank + 1) * share] for key, value in batch.items()}
    size = share // accumulation
    micro = [
        {key: value[i * size : (i + 1) * size] for key, value in mine.items()}
        for i in range(accumulation)
    ]
    net = model()
    grads = _Grads()
    trainer = Trainer(
        net,
        torch.optim.SGD(net.parameters(), lr=0.0),
        micro,
        callbacks=[grads],
        max_steps=1,
        settings=TrainerSettings(accumulation_steps=accumulation),
        distributed=distributed,
    )
    trainer.fit()
    torch.save({"grads": grads.grads}, Path(out) / f"rank{rank}.pt")
    teardown_distributed(distributed)
    return 0
