"""``speedtronic prepare --format chat`` versus plain ``prepare`` on text of the same size.

A corpus of multi-turn conversations (a system message every other row, 1-3 user/assistant
turns of 4-40 words) is written twice: as chat rows (``{"messages": [...]}``) and as plain
rows (``{"text": ...}``) holding the same words, one row per conversation. Both are
prepared with the same BPE tokenizer (trained here with ``tokenizers``, with the ChatML
special tokens and a ChatML template in its ``tokenizer_config.json``) with one tokenizing
thread (plain ``prepare --workers 1`` runs it in one worker process, the chat path in this
process); rounds alternate ABBA, and the table gives the median and best tokens/s of each
(the tokens each wrote over the CPU time of the ``prepare`` call, its worker processes
included: the machine is shared) and their ratio. Target (issue 31): chat >= 0.8x plain.

    python benchmarks/sft_prepare.py --rows 20000 --rounds 4      # --markdown for docs
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speedtronic.data.prepare import PrepareOptions, prepare  # noqa: E402
from speedtronic.data.sft_prepare import SFTOptions, prepare_examples  # noqa: E402

WORDS = (
    "the cat sat on a mat while seven dogs ran past quiet rain why how what yes no "
    "model answer question data token window train learn loss step"
).split()
TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))


def corpora(folder: Path, rows: int) -> tuple[Path, Path]:
    rng = random.Random(0)
    chat, plain = folder / "chat.jsonl", folder / "plain.jsonl"
    with chat.open("w") as chat_file, plain.open("w") as plain_file:
        for index in range(rows):
            messages = [{"role": "system", "content": "be brief"}] if index % 2 == 0 else []
            for _ in range(rng.randint(1, 3)):
                messages += [
                    {"role": "user", "content": sentence(rng)},
                    {"role": "assistant", "content": sentence(rng)},
                ]
            chat_file.write(json.dumps({"messages": messages}) + "\n")
            text = "\n".join(m["content"] for m in messages)
            plain_file.write(json.dumps({"text": text}) + "\n")
    return chat, plain


def tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(1)
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trained.decoder = decoders.ByteLevel()
    trained.train_from_iterator(
        [sentence(rng) for _ in range(2000)],
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    path = folder / "tokenizer.json"
    trained.save(str(path))
    config = {"eos_token": "<|endoftext|>", "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def cpu_seconds() -> float:
    """CPU time of this process and of its waited-for children: plain ``prepare``
    tokenizes in worker processes (``speedtronic.data.encode_pool``), which
    ``time.process_time`` alone would not count."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run(kind: str, corpus: Path, tok: Path, out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    started = cpu_seconds()
    if kind == "chat":
        result = prepare_examples(
            SFTOptions(inputs=[str(corpus)], tokenizer=str(tok), output=out, format="chat")
        )
    else:
        result = prepare(
            PrepareOptions(inputs=[str(corpus)], tokenizer=str(tok), output=out, eval_fraction=0.0)
        )
    return result.manifest.tokens / (cpu_seconds() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        chat, plain = corpora(folder, args.rows)
        tok = tokenizer(folder)
        sizes = {"chat": chat.stat().st_size, "plain": plain.stat().st_size}
        results: dict[str, list[float]] = {"plain": [], "chat": []}
        for round_ in range(args.rounds):
            order = ("plain", "chat") if round_ % 2 == 0 else ("chat", "plain")
            for kind in order:
                corpus = chat if kind == "chat" else plain
                results[kind].append(run(kind, corpus, tok, folder / f"out-{kind}"))
    median = {kind: statistics.median(values) for kind, values in results.items()}
    best = {kind: max(values) for kind, values in results.items()}
    print("| prepare | input | median tokens/s | best tokens/s |")
    print("|---|---|---:|---:|")
    for kind in ("plain", "chat"):
        label = "`--format chat`" if kind == "chat" else "plain text"
        size = f"{sizes[kind] / 2**20:.1f} MiB"
        print(f"| {label} | {size} | {median[kind]:,.0f} | {best[kind]:,.0f} |")
    print(
        f"| ratio | | {median['chat'] / median['plain']:.2f}x | "
        f"{best['chat'] / best['plain']:.2f}x |"
    )


if __name__ == "__main__":
    main()
