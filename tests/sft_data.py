"""Fine-tuning test data: a BPE tokenizer with chat special tokens, trained here with the
``tokenizers`` library, a ChatML-style template in its ``tokenizer_config.json``, and chat
and prompt-completion rows."""

from __future__ import annotations

import functools
import json
import random
import tempfile
from collections.abc import Sequence
from pathlib import Path

EOS, START, END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VOCAB = 300
TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WORDS = "the cat sat on a mat while seven dogs ran past quiet rain why how what yes no".split()


def sentence(rng: random.Random, low: int = 2, high: int = 9) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


@functools.lru_cache(maxsize=1)
def _tokenizer_bytes() -> bytes:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(5)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[EOS, START, END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([sentence(rng) for _ in range(300)], trainer)
    path = Path(tempfile.mkdtemp(prefix="speedtronic-chat-bpe-")) / "tokenizer.json"
    tokenizer.save(str(path))
    return path.read_bytes()


def chat_tokenizer(directory: Path, *, template: bool = True) -> Path:
    """``directory/tokenizer.json`` and, with ``template``, a ``tokenizer_config.json``
    holding the chat template."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    path.write_bytes(_tokenizer_bytes())
    config: dict[str, object] = {"eos_token": EOS}
    if template:
        config["chat_template"] = TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def chat_rows(count: int, seed: int = 0) -> list[dict[str, object]]:
    """Multi-turn conversations, every other one with a system message."""
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    for index in range(count):
        messages = [{"role": "system", "content": "be brief"}] if index % 2 == 0 else []
        for _ in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": sentence(rng)})
            messages.append({"role": "assistant", "content": sentence(rng)})
        rows.append({"messages": messages})
    return rows


def prompt_rows(count: int, seed: int = 1) -> list[dict[str, object]]:
    rng = random.Random(seed)
    return [
        {"prompt": sentence(rng) + " ->", "completion": " " + sentence(rng)} for _ in range(count)
    ]


def write_rows(path: Path, rows: Sequence[object]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path
