"""The Trainer's fine-tuning loss versus a hand-written masked loop, over 20 steps.

Chat rows (``benchmarks/sft_prepare.py``'s corpus and tokenizer) are prepared with
``--format chat --pack first-fit --window 128 --too-long split``; the windows are read with
``document_mask`` (loss masks and positions). Both sides start from the same weights and
AdamW and take the same batches (micro-batch 4, K=1): the Trainer with its own loss, the
hand loop with the cross-entropy summed over the labels that are not ``-100`` divided by
their count. It prints whether the 20 losses are bitwise equal and each side's steps/s.
``tests/test_sft.py::test_trainer_loss_equals_a_hand_written_masked_loop_bitwise`` asserts
the same on a smaller model.

    python benchmarks/sft_loss.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sft_prepare import corpora, tokenizer  # noqa: E402

from speedtronic.data.sft_prepare import SFTOptions, prepare_examples  # noqa: E402
from speedtronic.data.windows import open_token_dataset  # noqa: E402
from speedtronic.engine.settings import TrainerSettings  # noqa: E402
from speedtronic.engine.trainer import Trainer  # noqa: E402
from speedtronic.models.transformer import ReferenceTransformer  # noqa: E402

STEPS, WINDOW, VOCAB = 20, 128, 400


def fresh() -> tuple[ReferenceTransformer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = ReferenceTransformer(
        vocab_size=VOCAB, max_seq_len=WINDOW, n_layer=2, n_head=4, d_model=64, d_ff=128
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        chat, _ = corpora(folder, 400)
        options = SFTOptions(
            inputs=[str(chat)], tokenizer=str(tokenizer(folder)), output=folder / "sft",
            format="chat", pack="first-fit", window=WINDOW, too_long="split",
        )  # fmt: skip
        prepare_examples(options)
        dataset = open_token_dataset(folder / "sft", block_size=WINDOW, document_mask=True)
        batches = [dataset.__getitems__(list(range(i, i + 4))).batch() for i in range(0, 80, 4)]
    model, optimizer = fresh()
    started = time.perf_counter()
    result = Trainer(
        model, optimizer, batches, max_steps=STEPS, settings=TrainerSettings(metrics_every=1)
    ).fit()
    trainer_rate = STEPS / (time.perf_counter() - started)
    trainer = [float(record["loss"]) for record in result.metrics]
    model, optimizer = fresh()
    hand: list[float] = []
    started = time.perf_counter()
    for batch in batches[:STEPS]:
        logits = model(batch["input_ids"], position_ids=batch["position_ids"])["logits"]
        labels = batch["labels"].reshape(-1)
        total = F.cross_entropy(logits.reshape(-1, VOCAB).float(), labels, reduction="sum")
        loss = total / (labels != -100).sum()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        hand.append(float(loss.detach()))
    hand_rate = STEPS / (time.perf_counter() - started)
    print(f"bitwise equal over {STEPS} steps: {trainer == hand}")
    print(f"first/last loss: {trainer[0]:.6f} -> {trainer[-1]:.6f}")
    print(f"steps/s: Trainer {trainer_rate:.2f}, hand loop {hand_rate:.2f}")


if __name__ == "__main__":
    main()
