"""Corpora, a BPE tokenizer and a tiny run config for the token-shard tests.

The tokenizer is trained here with the ``tokenizers`` library on generated local text (no
download), once per test process, and saved as a ``tokenizer.json`` with an
``<|endoftext|>`` special token (id 0). ``run_config`` is ``configs/smoke.yaml`` shrunk to a
one-layer model that trains a few steps in well under a second.
"""

from __future__ import annotations

import functools
import json
import random
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
EOS = "<|endoftext|>"
WORDS = (
    "the cat sat on a mat while seven dogs ran fast past über naïve cafés "
    "and 日本 tea under quiet rain"
).split()
BPE_VOCAB = 320


def documents(count: int, *, seed: int = 0, low: int = 4, high: int = 40) -> list[str]:
    """``count`` documents of ``low`` to ``high`` random words."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))) for _ in range(count)
    ]


def write_jsonl(path: Path, texts: Iterable[str], *, key: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({key: text}) + "\n" for text in texts), encoding="utf-8")
    return path


@functools.lru_cache(maxsize=1)
def _trained_tokenizer() -> bytes:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents(400, seed=99), trainer)
    folder = Path(tempfile.mkdtemp(prefix="speedtronic-bpe-"))
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    return path.read_bytes()


def bpe_tokenizer(directory: Path) -> Path:
    """A copy of the test BPE tokenizer as ``directory/tokenizer.json`` (trained once)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    path.write_bytes(_trained_tokenizer())
    return path


def run_config(
    output_dir: Path, data: Mapping[str, object], **sections: Mapping[str, object]
) -> dict[str, object]:
    """``configs/smoke.yaml`` shrunk (one layer, d_model 16, block 16), with ``data`` as its
    data section and ``sections`` merged over the others."""
    config: dict[str, object] = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())
    config["run"] = {**_section(config, "run"), "output_dir": str(output_dir), "max_steps": 8}
    config["model"] = {
        **_section(config, "model"),
        "vocab_size": BPE_VOCAB,
        "max_seq_len": 16,
        "n_layer": 1,
        "n_head": 2,
        "n_kv_head": 2,
        "d_model": 16,
        "d_ff": 32,
    }
    config["data"] = {"micro_batch_size": 4, **data}
    config["scheduler"] = {**_section(config, "scheduler"), "warmup_steps": 1}
    config["logging"] = {"every_steps": 1, "console": False}
    config["checkpoint"] = {"enabled": True, "every_steps": 4, "keep_last": 2}
    for name, values in sections.items():
        config[name] = {**_section(config, name), **values}
    return config


def _section(config: Mapping[str, object], name: str) -> dict[str, object]:
    value = config.get(name)
    return dict(value) if isinstance(value, dict) else {}


def write_config(path: Path, config: Mapping[str, object]) -> Path:
    path.write_text(yaml.safe_dump(dict(config)), encoding="utf-8")
    return path


def losses(metrics: Path, key: str = "loss") -> dict[int, float]:
    """``step -> value`` of ``key`` in a run's metrics.jsonl (the steps that have it)."""
    found: dict[int, float] = {}
    for line in metrics.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if key in record:
            found[int(record["step"])] = float(record[key])
    return found


def eval_losses(metrics: Path) -> dict[int, float]:
    return losses(metrics, "eval/loss")


def tree_bytes(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (relative name -> bytes), to compare directories."""
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def siblings(directory: Path) -> Sequence[str]:
    """Names next to ``directory`` (staging leftovers would show here)."""
    return sorted(path.name for path in directory.parent.iterdir())
