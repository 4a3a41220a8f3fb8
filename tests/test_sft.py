"""Supervised fine-tuning data: ``prepare --format chat | prompt-completion`` writes token
shards with loss masks; training takes the loss on the answers only, packs without cross-talk,
resumes bitwise and equals a hand-written masked loop; bad rows exit 2 naming file and line.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from cli_runner import run_cli
from sft_data import EOS, chat_rows, chat_tokenizer, prompt_rows, write_rows

from speedtronic.data.windows import open_token_dataset
from speedtronic.engine.settings import TrainerSettings
from speedtronic.engine.trainer import Trainer
from speedtronic.models.transformer import ReferenceTransformer

WINDOW = 96


def prepare(tmp_path: Path, rows: list[dict[str, object]], fmt: str, *extra: str) -> Path:
    tokenizer = chat_tokenizer(tmp_path / "tok")
    data = write_rows(tmp_path / "rows" / "train.jsonl", rows)
    output = tmp_path / f"shards-{fmt}"
    result = run_cli(
        "prepare", "--format", fmt, "--input", str(data), "--tokenizer", str(tokenizer),
        "--output", str(output), *extra, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return output


def masked_text(directory: Path) -> tuple[str, dict[str, object]]:
    """The text of every loss-bearing token of the training shards, and the manifest."""
    from tokenizers import Tokenizer

    manifest = json.loads((directory / "index.json").read_text())
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    ids: list[int] = []
    for shard, mask in zip(manifest["shards"], manifest["loss_masks"], strict=True):
        tokens = np.fromfile(directory / shard["file"], dtype="<u2")
        flags = np.fromfile(directory / mask["file"], dtype=np.uint8)
        assert tokens.shape == flags.shape
        ids += tokens[flags == 1].tolist()
    return tokenizer.decode(ids, skip_special_tokens=False), manifest


def test_chat_rows_carry_the_loss_on_the_assistant_turns_only(tmp_path: Path) -> None:
    rows = chat_rows(12)
    directory = prepare(tmp_path, rows, "chat", "--eval-fraction", "0")
    text, manifest = masked_text(directory)
    expected = ""
    for row in rows:
        messages = row["messages"]
        assert isinstance(messages, list)
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        expected += "".join(f"{answer}<|im_end|>\n" for answer in answers) + EOS
    assert text == expected  # no system or user text, the template's turn ends included
    assert manifest["sft"] == {
        "format": "chat", "pack": "concatenate", "window": None, "examples": 12,
    }  # fmt: skip


def test_prompt_completion_rows_carry_the_loss_on_the_completion(tmp_path: Path) -> None:
    rows = prompt_rows(10)
    directory = prepare(tmp_path, rows, "prompt-completion", "--eval-fraction", "0")
    text, _ = masked_text(directory)
    assert text == "".join(f"{row['completion']}{EOS}" for row in rows)


def test_first_fit_packs_whole_examples_into_windows(tmp_path: Path) -> None:
    directory = prepare(
        tmp_path, chat_rows(30), "chat", "--pack", "first-fit", "--window", str(WINDOW),
        "--too-long", "split", "--eval-fraction", "0",
    )  # fmt: skip
    dataset = open_token_dataset(directory, block_size=WINDOW, document_mask=True)
    manifest = json.loads((directory / "index.json").read_text())
    tokens = manifest["shards"][0]["tokens"]
    assert (tokens - 1) % WINDOW == 0 and len(dataset) == (tokens - 1) // WINDOW
    batch = dataset.__getitems__(list(range(len(dataset)))).batch()
    # A window is a bin: it starts an example (or a piece of a split one), and its last
    # label -- the next bin's first token -- is no target.
    start = dataset.manifest.eos_id + 1  # <|im_start|>
    pieces = batch["input_ids"][:, 0] != start
    assert pieces.sum() < len(dataset) // 4
    assert (batch["labels"][:, -1] == -100).all()
    assert (batch["labels"] != -100).any(dim=1).sum() > len(dataset) // 2
    with pytest.raises(Exception, match="packed first-fit into windows of 96"):
        open_token_dataset(directory, block_size=32)


def run_yaml(tmp_path: Path, shards: Path, name: str, **data: object) -> Path:
    config = {
        "run": {"device": "cpu", "max_steps": 6, "output_dir": str(tmp_path / name), "seed": 3},
        "model": {"name": "reference_transformer", "vocab_size": 300, "max_seq_len": WINDOW,
                  "n_layer": 1, "n_head": 2, "d_model": 16, "d_ff": 32},
        "data": {"tokens": str(shards), "micro_batch_size": 2, "target_batch_size": 4, **data},
        "optimizer": {"name": "adamw", "lr": 3e-3},
        "scheduler": {"warmup_steps": 1},
        "logging": {"every_steps": 1, "console": False},
        "checkpoint": {"every_steps": 3},
    }  # fmt: skip
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def losses(run: Path) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {json.loads(line)["step"]: json.loads(line)["loss"] for line in lines}


@pytest.mark.parametrize(
    ("fmt", "extra", "data"),
    [
        (
            "chat",
            ("--pack", "first-fit", "--window", str(WINDOW), "--too-long", "split"),
            {"document_mask": True},
        ),
        ("prompt-completion", (), {}),
    ],
)
def test_prepare_train_and_resume_bitwise(
    tmp_path: Path, fmt: str, extra: tuple[str, ...], data: dict[str, object]
) -> None:
    rows = chat_rows(60) if fmt == "chat" else prompt_rows(80)
    shards = prepare(tmp_path, rows, fmt, *extra, "--eval-fraction", "0.1")
    full = run_yaml(tmp_path, shards, "full", **data)
    part = run_yaml(tmp_path, shards, "part", **data)
    assert run_cli("fit", "--config", str(full), cwd=tmp_path).returncode == 0
    assert run_cli("fit", "--config", str(part), "--max-steps", "3", cwd=tmp_path).returncode == 0
    resumed = run_cli("fit", "--config", str(part), "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert losses(tmp_path / "part") == losses(tmp_path / "full")
    assert sorted(losses(tmp_path / "full")) == list(range(1, 7))


def test_trainer_loss_equals_a_hand_written_masked_loop_bitwise(tmp_path: Path) -> None:
    shards = prepare(tmp_path, chat_rows(40), "chat", "--pack", "first-fit", "--window",
                     str(WINDOW), "--too-long", "split", "--eval-fraction", "0")  # fmt: skip
    dataset = open_token_dataset(shards, block_size=WINDOW, document_mask=True)
    batches = [dataset.__getitems__([i, i + 1]).batch() for i in range(0, len(dataset) - 1, 2)]
    steps = 20

    def fresh() -> tuple[ReferenceTransformer, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = ReferenceTransformer(
            vocab_size=300, max_seq_len=WINDOW, n_layer=1, n_head=2, d_model=16, d_ff=32
        )
        return model, torch.optim.AdamW(model.parameters(), lr=3e-3)

    model, optimizer = fresh()
    result = Trainer(
        model, optimizer, batches, max_steps=steps, settings=TrainerSettings(metrics_every=1)
    ).fit()
    trainer_losses = [float(record["loss"]) for record in result.metrics]

    model, optimizer = fresh()
    hand: list[float] = []
    for step in range(steps):
        batch = batches[step % len(batches)]
        logits = model(batch["input_ids"], position_ids=batch["position_ids"])["logits"]
        labels = batch["labels"].reshape(-1)
        total = F.cross_entropy(logits.reshape(-1, 300).float(), labels, reduction="sum")
        loss = total / (labels != -100).sum()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        hand.append(float(loss.detach()))
    assert trainer_losses == hand


# -- bad input ------------------------------------------------------------------------------


def bad(tmp_path: Path, rows: list[object], fmt: str = "chat", *extra: str) -> str:
    tokenizer = chat_tokenizer(tmp_path / "tok", template="--no-template" not in extra)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    flags = [flag for flag in extra if flag != "--no-template"]
    result = run_cli(
        "prepare", "--format", fmt, "--input", str(data), "--tokenizer", str(tokenizer),
        "--output", str(tmp_path / "out"), *flags, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()
    return lines[0]


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def test_a_chat_row_without_messages(tmp_path: Path) -> None:
    message = bad(tmp_path, [GOOD, {"conversation": []}])
    assert "rows.jsonl:2: no 'messages'" in message


def test_a_role_the_template_does_not_know(tmp_path: Path) -> None:
    row = {"messages": [{"role": "tool", "content": "42"}, *GOOD["messages"]]}  # type: ignore[list-item]
    message = bad(tmp_path, [GOOD, GOOD, row])
    assert "rows.jsonl:3:" in message and "unknown role tool" in message


SKIPPING = (
    "{% for message in messages %}{% if message['role'] != 'tool' %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""A template that silently leaves out a role it does not know."""


def test_a_role_the_template_skips(tmp_path: Path) -> None:
    skipping = tmp_path / "skip.jinja"
    skipping.write_text(SKIPPING)
    row = {"messages": [{"role": "tool", "content": "42"}, *GOOD["messages"]]}  # type: ignore[list-item]
    message = bad(tmp_path, [row], "chat", "--chat-template", str(skipping))
    assert "rows.jsonl:1:" in message and "'tool'" in message


def test_a_tokenizer_without_a_chat_template(tmp_path: Path) -> None:
    message = bad(tmp_path, [GOOD], "chat", "--no-template")
    assert "has no chat template" in message and "--chat-template" in message


def test_an_example_with_no_loss_bearing_token(tmp_path: Path) -> None:
    row = {"messages": [{"role": "user", "content": "hi"}]}
    assert "rows.jsonl:2: no 'assistant' message" in bad(tmp_path, [GOOD, row])
    empty = [{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": ""}]
    assert "rows.jsonl:2: the completion is empty" in bad(tmp_path, empty, "prompt-completion")


def test_a_document_longer_than_a_window_with_splitting_off(tmp_path: Path) -> None:
    long = {"prompt": "the cat " * 40, "completion": " sat"}
    message = bad(tmp_path, [{"prompt": "a", "completion": "b"}, long], "prompt-completion",
                  "--pack", "first-fit", "--window", "16")  # fmt: skip
    assert "rows.jsonl:2: the example is" in message and "--too-long split" in message


def test_flags_of_the_other_formats_are_refused(tmp_path: Path) -> None:
    assert "apply to --format text" in bad(tmp_path, [GOOD], "chat", "--workers", "2")
    message = bad(tmp_path, [GOOD], "text", "--window", "16")
    assert "apply to --format chat and --format prompt-completion" in message


def test_a_bad_row_leaves_an_existing_output_as_it_was(tmp_path: Path) -> None:
    output = prepare(tmp_path, chat_rows(6), "chat", "--eval-fraction", "0")
    before = {path.name: path.read_bytes() for path in output.iterdir()}
    data = write_rows(tmp_path / "rows" / "train.jsonl", [GOOD, {"conversation": []}])
    result = run_cli(
        "prepare", "--format", "chat", "--input", str(data), "--tokenizer",
        str(tmp_path / "tok" / "tokenizer.json"), "--output", str(output), "--overwrite",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2 and "train.jsonl:2: no 'messages'" in result.stderr
    assert {path.name: path.read_bytes() for path in output.iterdir()} == before
