"""``speedtronic tokenizer`` (``speedtronic.data.train_tokenizer``): a byte-level BPE trained
with ``tokenizers`` on the inputs ``prepare`` reads, ``<|endoftext|>`` at id 0, the same bytes
from the same corpus, and ``prepare`` takes it. Real processes (forked, tests/forked.py)."""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from forked import Forked, cli_main
from token_data import documents, write_jsonl

from speedtronic.data import read_manifest


def corpus(tmp_path: Path) -> list[str]:
    """A JSONL file of documents and a plain-text file: two of prepare's input forms."""
    write_jsonl(tmp_path / "corpus" / "docs.jsonl", documents(200, seed=5))
    (tmp_path / "corpus" / "manual.txt").write_text(
        "\n".join(documents(40, seed=6)), encoding="utf-8"
    )
    return ["--input", "corpus/*.jsonl", "--input", "corpus/manual.txt"]


def test_a_trained_tokenizer_is_deterministic_and_prepare_takes_it(
    forked: Forked, tmp_path: Path
) -> None:
    inputs = corpus(tmp_path)
    children = [
        forked.start(
            cli_main, "tokenizer", *inputs, "--vocab-size", "300", "--output", name, cwd=tmp_path
        )
        for name in ("first.json", "second.json")
    ]
    assert [child.wait(timeout=120) for child in children] == [0, 0], children[0].output
    assert "byte-level BPE of 300 ids (<|endoftext|> is id 0), trained on 201 documents from 2" in (
        children[0].output
    )
    first = (tmp_path / "first.json").read_bytes()
    assert first == (tmp_path / "second.json").read_bytes()  # the same bytes twice
    trained = tokenizers.Tokenizer.from_file(str(tmp_path / "first.json"))
    assert trained.get_vocab_size() == 300 and trained.token_to_id("<|endoftext|>") == 0
    text = "naïve cafés 日本 \x00 emoji 🙂"  # byte-level: anything encodes and comes back
    assert trained.decode(trained.encode(text).ids) == text
    assert json.loads(first)["model"]["type"] == "BPE"
    prepare = forked.start(
        cli_main, "prepare", *inputs, "--tokenizer", "first.json", "--output", "shards",
        cwd=tmp_path,
    )  # fmt: skip
    assert prepare.wait(timeout=120) == 0, prepare.output
    manifest = read_manifest(tmp_path / "shards")
    assert manifest.eos_id == 0 and manifest.vocab_size <= 300


def test_tokenizer_mistakes_exit_2_with_one_line(forked: Forked, tmp_path: Path) -> None:
    inputs = corpus(tmp_path)
    (tmp_path / "taken.json").write_text("{}")
    cases = {
        "--vocab-size: 100 is below 257": [*inputs, "--vocab-size", "100", "--output", "t.json"],
        "taken.json exists; pass --overwrite": [*inputs, "--output", "taken.json"],
        "no such file": ["--input", "missing.jsonl", "--output", "t.json"],
    }
    children = {
        expected: forked.start(cli_main, "tokenizer", *argv, cwd=tmp_path)
        for expected, argv in cases.items()
    }
    for expected, child in children.items():
        assert child.wait(timeout=60) == 2, child.output
        lines = child.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("speedtronic: error:"), lines
        assert expected in lines[0], lines[0]
    assert not (tmp_path / "t.json").exists()
    assert (tmp_path / "taken.json").read_text() == "{}"


def test_tokenizer_reads_its_inputs_as_prepare_does(forked: Forked, tmp_path: Path) -> None:
    """Several paths after one --input (what an unquoted glob becomes), documents separated
    inside a text file (--doc-separator), an extensionless file read by --input-format."""
    (tmp_path / "a.txt").write_text("one two three\n%\nfour five\n%\nsix\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text("seven eight\n%\nnine ten\n", encoding="utf-8")
    (tmp_path / "notes").write_text('{"text": "eleven twelve"}\n', encoding="utf-8")
    runs = {
        "separated": ["--input", "a.txt", "b.txt", "--doc-separator", "%"],
        "as jsonl": ["--input", "notes", "--input-format", "jsonl"],
    }
    outputs = {}
    for label, inputs in runs.items():
        child = forked.start(
            cli_main, "tokenizer", *inputs, "--vocab-size", "270", "--min-frequency", "1",
            "--output", f"{label}.json", cwd=tmp_path,
        )  # fmt: skip
        assert child.wait(timeout=120) == 0, child.output
        outputs[label] = child.output
    assert "trained on 5 documents from 2 file(s)" in outputs["separated"]
    assert "trained on 1 documents from 1 file(s)" in outputs["as jsonl"]
