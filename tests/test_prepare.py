"""Issue 23, items 1-3 through the CLI: ``speedtronic prepare`` -> ``speedtronic fit`` on the
token shards -> ``--resume``, bit for bit; the bad inputs of the issue, each an exit 2 with
one message that names what and where, and no shard directory damaged.

Everything runs in process (``cli_runner.run_cli``); the tokenizer is a BPE trained in the
test on local text (``token_data``).
"""

from __future__ import annotations

import io
import json
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from cli_runner import CliResult, run_cli
from forked import Forked
from token_data import (
    BPE_VOCAB,
    bpe_tokenizer,
    documents,
    eval_losses,
    losses,
    run_config,
    siblings,
    tree_bytes,
    write_config,
    write_jsonl,
)

import speedtronic.data.prepare as prepare_module
from speedtronic.data import read_manifest
from speedtronic.data.prepare import PrepareOptions, prepare
from speedtronic.data.shards import MANIFEST_NAME

EXIT_USAGE = 2


def prepare_cli(cwd: Path, *args: str) -> CliResult:
    return run_cli("prepare", *args, cwd=cwd)


def one_error(done: CliResult) -> str:
    """The single ``speedtronic: error:`` line of a usage failure."""
    assert done.returncode == EXIT_USAGE, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("speedtronic: error: "), done.stderr
    return lines[0]


@pytest.fixture()
def workspace(tmp_path: Path) -> Path:
    """A directory with the test tokenizer and a corpus of two JSONL files."""
    bpe_tokenizer(tmp_path)
    texts = documents(120, seed=1)
    write_jsonl(tmp_path / "corpus" / "a.jsonl", texts[:60])
    write_jsonl(tmp_path / "corpus" / "b.jsonl", texts[60:])
    return tmp_path


def prepared(workspace: Path, output: str = "shards", *extra: str) -> Path:
    done = prepare_cli(
        workspace,
        "--input", "corpus/*.jsonl", "--tokenizer", "tokenizer.json", "--output", output,
        "--shard-tokens", "500", "--eval-fraction", "0.1", *extra,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return workspace / output


# -- prepare -> fit -> resume -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["jsonl", "txt"])
def test_prepare_fit_and_resume_on_token_shards_is_bitwise(tmp_path: Path, kind: str) -> None:
    bpe_tokenizer(tmp_path)
    texts = documents(120, seed=1)
    if kind == "jsonl":
        write_jsonl(tmp_path / "corpus" / "part-a.jsonl", texts[:70])
        write_jsonl(tmp_path / "corpus" / "part-b.jsonl", texts[70:])
    else:  # a .txt file is one document
        (tmp_path / "corpus").mkdir()
        for index in range(30):
            text = " ".join(texts[4 * index : 4 * index + 4])
            (tmp_path / "corpus" / f"doc{index:02d}.txt").write_text(text, encoding="utf-8")
    done = prepare_cli(
        tmp_path,
        "--input", f"corpus/*.{kind}", "--tokenizer", "tokenizer.json", "--output", "shards",
        "--shard-tokens", "400", "--eval-fraction", "0.1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("prepared shards: ")
    manifest = read_manifest(tmp_path / "shards")
    assert manifest.documents == (120 if kind == "jsonl" else 30)
    assert len(manifest.split("train")) > 2 and manifest.split("eval")
    assert (tmp_path / "shards" / "tokenizer.json").read_bytes() == (
        tmp_path / "tokenizer.json"
    ).read_bytes()

    data = {"tokens": "shards", "tokenizer": "tokenizer.json"}
    for name in ("full", "part"):
        config = run_config(tmp_path / name, data, eval={"every_steps": 3})
        write_config(tmp_path / f"{name}.yaml", config)
    assert run_cli("fit", "--config", "full.yaml", cwd=tmp_path).returncode == 0
    first = run_cli("fit", "--config", "part.yaml", "--max-steps", "5", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    second = run_cli("fit", "--config", "part.yaml", "--resume", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "(this run: 3 steps)" in second.stdout  # resumed at step 5, mid-epoch
    reference = losses(tmp_path / "full" / "metrics.jsonl")
    assert sorted(reference) == list(range(1, 9))
    assert losses(tmp_path / "part" / "metrics.jsonl") == reference
    held_out = eval_losses(tmp_path / "full" / "metrics.jsonl")
    assert sorted(held_out) == [3, 6, 8]
    resumed = eval_losses(tmp_path / "part" / "metrics.jsonl")
    assert sorted(resumed) == [3, 5, 6, 8]  # the stopped run also evaluated its last step
    assert {step: resumed[step] for step in held_out} == held_out
    # speedtronic evaluate: the last checkpoint on the held-out shards, as the fit scored it
    evaluated = run_cli("evaluate", "--config", "full.yaml", cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr
    assert evaluated.stdout.startswith(f"eval/loss={held_out[8]!r} ")


def test_prepare_output_is_byte_identical_for_one_and_two_workers(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (workspace / "corpus" / "c.txt").write_text(" ".join(documents(40, seed=5)), encoding="utf-8")
    monkeypatch.setattr(prepare_module, "BATCH_CHARS", 300)  # many batches in flight
    trees = []
    for workers in ("1", "2"):
        output = f"shards-{workers}"
        done = prepare_cli(
            workspace,
            "--input", "corpus", "--tokenizer", "tokenizer.json", "--output", output,
            "--shard-tokens", "300", "--workers", workers,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        trees.append(tree_bytes(workspace / output))
    assert trees[0] == trees[1]
    assert len([name for name in trees[0] if name.endswith(".bin")]) > 5


def test_prepare_prints_one_summary_line_and_a_bar_only_on_a_terminal(workspace: Path) -> None:
    done = prepare_cli(
        workspace, "--input", "corpus", "--tokenizer", "tokenizer.json", "--output", "shards"
    )
    assert done.returncode == 0 and done.stderr == ""
    manifest = read_manifest(workspace / "shards")
    assert done.stdout.splitlines() == [
        f"prepared shards: 120 documents from 2 file(s), {manifest.tokens:,} uint16 tokens in 1 "
        f"training + 1 held-out shard(s) ({manifest.split('eval')[0].tokens:,} tokens held "
        f"out) in {done.stdout.split(' in ')[-1].split(' s ')[0]} s "
        + done.stdout.split(" s ")[-1].strip()
    ]

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    options = PrepareOptions(
        inputs=[str(workspace / "corpus")],
        tokenizer=str(workspace / "tokenizer.json"),
        output=workspace / "again",
    )
    prepare(options, progress=terminal)
    assert "prepare" in terminal.getvalue() and "100%" in terminal.getvalue()


def test_prepare_reads_parquet_and_the_byte_tokenizer_is_built_in(workspace: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = documents(10, seed=3)
    pq.write_table(pa.table({"body": texts}), workspace / "docs.parquet")
    done = prepare_cli(
        workspace,
        "--input", "docs.parquet", "--text-key", "body", "--tokenizer", "bytes",
        "--output", "bytes-shards", "--eval-fraction", "0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    manifest = read_manifest(workspace / "bytes-shards")
    assert (manifest.vocab_size, manifest.eos_id, manifest.tokenizer.kind) == (257, 256, "bytes")
    assert not (workspace / "bytes-shards" / "tokenizer.json").exists()
    raw = (workspace / "bytes-shards" / "train-00000.bin").read_bytes()
    tokens = [int.from_bytes(raw[i : i + 2], "little") for i in range(0, len(raw), 2)]
    expected = [t for text in texts for t in [*text.encode("utf-8"), 256]]
    assert tokens == expected
    # A dictionary-encoded column (pandas' category dtype) and a large_string one read alike.
    column = pa.array(texts + texts[:3]).dictionary_encode()
    large = pa.array(texts[3:], type=pa.large_string())
    pq.write_table(pa.table({"body": column}), workspace / "category.parquet")
    pq.write_table(pa.table({"body": large}), workspace / "large.parquet")
    done = prepare_cli(
        workspace,
        "--input", "category.parquet", "--input", "large.parquet", "--text-key", "body",
        "--tokenizer", "bytes", "--output", "category-shards", "--eval-fraction", "0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    raw = (workspace / "category-shards" / "train-00000.bin").read_bytes()
    again = [t for text in texts + texts[:3] + texts[3:] for t in [*text.encode("utf-8"), 256]]
    assert [int.from_bytes(raw[i : i + 2], "little") for i in range(0, len(raw), 2)] == again


def test_a_vocabulary_with_ids_beyond_65535_gets_uint32_shards(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 70_000}, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["</s>"])
    tokenizer.save(str(tmp_path / "wide.json"))
    write_jsonl(tmp_path / "c.jsonl", ["hello world", "world"])
    done = prepare_cli(
        tmp_path, "--input", "c.jsonl", "--tokenizer", "wide.json", "--output", "s",
        "--eval-fraction", "0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    manifest = read_manifest(tmp_path / "s")
    eos = manifest.eos_id
    assert (manifest.dtype, manifest.vocab_size, eos) == ("uint32", 70_001, 3)
    raw = (tmp_path / "s" / "train-00000.bin").read_bytes()
    tokens = [int.from_bytes(raw[i : i + 4], "little") for i in range(0, len(raw), 4)]
    assert tokens == [1, 70_000, eos, 70_000, eos]


# -- bad input to prepare -------------------------------------------------------------------------


def _corpus_file(workspace: Path, name: str, data: bytes) -> str:
    path = workspace / "bad" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return f"bad/{name}"


BAD_CORPORA = {
    "jsonl-without-text-key": (
        "a.jsonl",
        b'{"text": "fine"}\n{"text": "also fine"}\n{"content": "no text key"}\n',
        r"bad/a\.jsonl:3: no 'text' key \(the row has 'content'\); name the text field "
        r"with --text-key",
    ),
    "malformed-json-line": (
        "a.jsonl",
        b'{"text": "fine"}\n{"text" "no colon"}\n',
        r"bad/a\.jsonl:2: malformed JSON at column 9 \(Expecting ':' delimiter\)",
    ),
    "jsonl-invalid-utf8": (
        "a.jsonl",
        b'{"text": "fine"}\n{"text": "caf\xe9"}\n',
        r"bad/a\.jsonl:2: invalid UTF-8 at byte 30 \(invalid continuation byte\)",
    ),
    "txt-invalid-utf8": (
        "a.txt",
        "héllo ".encode() * 3 + b"\xff rest",
        r"bad/a\.txt: invalid UTF-8 at byte 21 \(invalid start byte\)",
    ),
    "txt-binary": (
        "a.txt",
        b"abc\x00\x01\x02",
        r"bad/a\.txt: binary data, not text \(a NUL byte at byte 3\)",
    ),
    "text-not-a-string": (
        "a.jsonl",
        b'{"text": 7}\n',
        r"bad/a\.jsonl:1: 'text' is int, not a string",
    ),
    "empty-corpus": (
        "a.jsonl",
        b'\n{"text": ""}\n  \n',
        r"empty corpus: the input\(s\) hold no text \(bad/a\.jsonl\)",
    ),
    "unknown-suffix": (
        "a.bin",
        b"\x00\x01",
        r"--input bad/a\.bin: not a \.txt, \.jsonl, \.parquet file",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_CORPORA))
def test_bad_corpus_is_one_error_naming_the_file_and_place(workspace: Path, case: str) -> None:
    name, data, expected = BAD_CORPORA[case]
    source = _corpus_file(workspace, name, data)
    good = prepared(workspace)
    before = tree_bytes(good)
    for output in ("fresh", "shards"):  # a new directory, and replacing a shard set
        overwrite = ["--overwrite"] if output == "shards" else []
        done = prepare_cli(
            workspace, "--input", source, "--tokenizer", "tokenizer.json", "--output", output,
            *overwrite,
        )  # fmt: skip
        message = one_error(done)
        assert re.search(expected, message), message
    assert not (workspace / "fresh").exists()
    assert tree_bytes(good) == before
    assert [name for name in siblings(good) if name.startswith(".")] == []


def test_bad_inputs_and_outputs_are_refused_before_any_work(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = prepared(workspace)
    before = tree_bytes(good)
    (workspace / "blobs").mkdir()
    (workspace / "blobs" / "a.bin").write_bytes(b"\x00" * 10)
    (workspace / "blobs" / "b.npy").write_bytes(b"\x93NUMPY")
    (workspace / "notes").mkdir()
    (workspace / "notes" / "keep.md").write_text("mine")
    tok = ["--tokenizer", "tokenizer.json"]
    cases = [
        (["--input", "blobs", *tok, "--output", "x"],
         "--input blobs: a directory with no .txt, .jsonl, .parquet files in it (2 other "
         "files: a.bin, b.npy)"),
        (["--input", "corpus/*.txt", *tok, "--output", "x"],
         "--input 'corpus/*.txt' matches no file"),
        (["--input", "nope.jsonl", *tok, "--output", "x"],
         "--input nope.jsonl: no such file or directory"),
        (["--input", "corpus", *tok, "--output", "shards"],
         "--output shards: the directory is not empty; pass --overwrite to replace the shards "
         "in it (the old shards stay until the new set is complete)"),
        (["--input", "corpus", *tok, "--output", "notes", "--overwrite"],
         "--output notes: --overwrite replaces only a directory of token shards (one with "
         "index.json), and this one is not: choose another --output"),
        (["--input", "shards/../corpus", *tok, "--output", "corpus", "--overwrite"],
         "--output corpus: --overwrite replaces only a directory of token shards"),
        (["--input", "corpus", "--tokenizer", "missing.json", "--output", "x"],
         "tokenizer file not found: missing.json"),
        (["--input", "corpus", *tok, "--output", "x", "--eos-token", "<nope>"],
         "--eos-token '<nope>' is not a token of tokenizer.json"),
        (["--input", "corpus", *tok, "--output", "x", "--eval-fraction", "1"],
         "--eval-fraction must be in [0, 1), got 1.0"),
        (["--input", "corpus", *tok, "--output", "x", "--workers", "0"],
         "--workers must be in [1, 1024], got 0"),
        (["--input", "corpus", "--tokenizer", "bytes", "--output", "x", "--eos-token", "."],
         "--eos-token '.': the byte tokenizer's end-of-document id is always 256"),
    ]  # fmt: skip
    for args, expected in cases:
        message = one_error(prepare_cli(workspace, *args))
        assert expected in message, (args, message)
    assert not (workspace / "x").exists()
    assert tree_bytes(good) == before
    assert (workspace / "notes" / "keep.md").read_text() == "mine"


def test_tokenizer_problems_are_one_error_each(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    plain = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, "<unk>"))
    plain.pre_tokenizer = pre_tokenizers.Whitespace()
    plain.save(str(workspace / "no-eos.json"))
    (workspace / "broken.json").write_text('{"model": ')
    huge = json.loads(plain.to_str())
    huge["model"]["vocab"]["b"] = 2**32  # not a u32 id: tokenizers cannot load it
    (workspace / "huge.json").write_text(json.dumps(huge))
    args = ["--input", "corpus", "--output", "x", "--tokenizer"]
    message = one_error(prepare_cli(workspace, *args, "no-eos.json"))
    assert message.endswith(
        "no-eos.json names no end-of-document token (special tokens: none); pass --eos-token "
        "with the token that ends a document"
    )
    for name in ("broken.json", "huge.json"):
        message = one_error(prepare_cli(workspace, *args, name))
        assert f"{name}: not a tokenizer file the tokenizers library can load (" in message

    # A vocabulary beyond uint32 (no real tokenizer file can hold one: tokenizers' ids are
    # u32) is refused by the dtype rule, before anything is written.
    real = prepare_module.load_tokenizer

    def wide(spec: str) -> object:
        loaded = real(spec)
        loaded.vocab_size = 2**32 + 1  # type: ignore[misc]  # a FileTokenizer attribute
        return loaded

    monkeypatch.setattr(prepare_module, "load_tokenizer", wide)
    message = one_error(prepare_cli(workspace, *args, "tokenizer.json"))
    assert message.endswith(
        "a vocabulary of 4,294,967,297 token ids does not fit token shards (at most 2^32 = "
        "4,294,967,296 ids, uint32)"
    )
    assert not (workspace / "x").exists()


def test_a_missing_extra_names_the_install_line(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a b"]}), workspace / "d.parquet")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers -> ImportError
    message = one_error(
        prepare_cli(
            workspace, "--input", "corpus", "--tokenizer", "tokenizer.json", "--output", "x"
        )
    )
    assert message.endswith(
        "the tokenizer tokenizer.json needs the 'tokenizers' package: pip install "
        '"speedtronic[hf]"'
    )
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    message = one_error(
        prepare_cli(workspace, "--input", "d.parquet", "--tokenizer", "bytes", "--output", "x")
    )
    assert message.endswith(
        "reading d.parquet needs the 'pyarrow' package: pip install \"speedtronic[hf]\""
    )


def test_parquet_without_the_column_or_with_a_null_is_one_error(workspace: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), workspace / "other.parquet")
    pq.write_table(pa.table({"text": ["x", None]}), workspace / "null.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), workspace / "ints.parquet")
    (workspace / "junk.parquet").write_bytes(b"PAR1 not really")
    expected = {
        "other.parquet": "other.parquet: no column 'text' (columns: 'body'); name the text "
        "column with --text-key",
        "null.parquet": "null.parquet: row 2 of column 'text' is null",
        "ints.parquet": "ints.parquet: column 'text' is int64, not a string column",
        "junk.parquet": "junk.parquet: not a readable parquet file (",
    }
    for name, text in expected.items():
        message = one_error(
            prepare_cli(workspace, "--input", name, "--tokenizer", "bytes", "--output", "x")
        )
        assert text in message, message


# -- nothing is lost -------------------------------------------------------------------------------


def test_overwrite_replaces_the_old_shards_only_once_the_new_set_is_complete(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = prepared(workspace)
    before = tree_bytes(good)
    write_jsonl(workspace / "more" / "a.jsonl", documents(50, seed=8))
    (workspace / "more" / "b.jsonl").write_text('{"text": "x"}\n{broken\n')
    args = ["--input", "more", "--tokenizer", "tokenizer.json", "--output", "shards"]
    message = one_error(prepare_cli(workspace, *args, "--overwrite", "--shard-tokens", "50"))
    assert "more/b.jsonl:2: malformed JSON" in message
    assert tree_bytes(good) == before  # the failed run wrote several shards, elsewhere

    def interrupted(*_: object, **__: object) -> None:
        raise KeyboardInterrupt  # while writing the manifest, the very last step

    (workspace / "more" / "b.jsonl").unlink()
    with monkeypatch.context() as patch:
        patch.setattr(prepare_module, "atomic_write_text", interrupted)
        done = prepare_cli(workspace, *args, "--overwrite")
    assert done.returncode == 130
    assert tree_bytes(good) == before
    assert [name for name in siblings(good) if name.startswith(".")] == []

    done = prepare_cli(workspace, *args, "--overwrite")
    assert done.returncode == 0, done.stderr
    assert read_manifest(good).documents == 50
    assert sorted(siblings(good)) == sorted(["corpus", "more", "shards", "tokenizer.json"])


def prepare_and_stall(workspace: str, ready: str) -> int:
    """A forked child: prepare, but stall before the manifest (to be killed there)."""
    import os

    import speedtronic.data.prepare as module

    def stall(*_: object, **__: object) -> None:
        Path(ready).touch()
        time.sleep(600)

    module._manifest = stall  # type: ignore[assignment]  # the child's own copy of the module
    os.chdir(workspace)
    options = PrepareOptions(
        inputs=["corpus"], tokenizer="tokenizer.json", output="shards", shard_tokens=100
    )
    module.prepare(options)
    return 0


def test_a_killed_prepare_leaves_no_shard_set_behind(workspace: Path, forked: Forked) -> None:
    ready = workspace / "ready"
    child = forked.start(prepare_and_stall, str(workspace), str(ready))
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert child.poll() is None, child.output
        assert time.monotonic() < deadline, child.output
        time.sleep(0.02)
    child.send_signal(signal.SIGKILL)
    child.wait(30)
    assert not (workspace / "shards").exists()
    staging = [path for path in workspace.iterdir() if path.name.startswith(".shards.prepare-")]
    assert len(staging) == 1  # what a killed run leaves: parts, and no manifest
    assert not (staging[0] / MANIFEST_NAME).exists()
    assert len(list(staging[0].glob(".part-*.bin"))) > 3


# -- bad shards at fit -----------------------------------------------------------------------------


def _fit(workspace: Path, data: dict[str, object], *extra: str, **sections: object) -> CliResult:
    config = run_config(workspace / "run", data, **sections)  # type: ignore[arg-type]  # sections
    write_config(workspace / "run.yaml", config)
    return run_cli("fit", "--config", "run.yaml", "--max-steps", "2", *extra, cwd=workspace)


def test_fit_refuses_shards_that_do_not_match_their_manifest(workspace: Path) -> None:
    shards = prepared(workspace)
    first = shards / "train-00000.bin"
    original = first.read_bytes()
    first.write_bytes(original[:-2])
    message = one_error(_fit(workspace, {"tokens": "shards"}))
    assert message.startswith("speedtronic: error: data.tokens: shards/train-00000.bin: ")
    assert message.endswith(
        f"shards/train-00000.bin: {len(original) - 2:,} bytes, but index.json records "
        f"{len(original) // 2} uint16 tokens ({len(original):,} bytes): the shard is truncated "
        "or was replaced; prepare the shards again"
    )
    modified = bytearray(original)
    modified[10] ^= 1
    first.write_bytes(bytes(modified))
    message = one_error(_fit(workspace, {"tokens": "shards"}))
    assert "shards/train-00000.bin: sha256 " in message and "the shard was modified" in message
    # verify_shards: false checks sizes only (the documented trade-off for huge corpora)
    assert _fit(workspace, {"tokens": "shards", "verify_shards": False}).returncode == 0
    first.unlink()
    message = one_error(_fit(workspace, {"tokens": "shards"}))
    assert message.endswith(
        "shards/train-00000.bin: missing (index.json lists it); prepare the shards again"
    )


def test_fit_refuses_another_tokenizer_a_small_model_and_a_bad_manifest(workspace: Path) -> None:
    shards = prepared(workspace)
    message = one_error(_fit(workspace, {"tokens": "shards", "tokenizer": "bytes"}))
    assert "data.tokenizer: bytes (sha256 " in message
    assert "is not the tokenizer shards was prepared with (shards/tokenizer.json" in message
    small = {"model": {"vocab_size": 100}}
    expected = (
        f"data.tokens: shards holds token ids up to {BPE_VOCAB - 1} (a vocabulary of "
        f"{BPE_VOCAB}), more than the model's vocabulary of 100 (model.vocab_size)"
    )
    assert expected in one_error(_fit(workspace, {"tokens": "shards"}, **small))
    config = run_config(workspace / "run", {"tokens": "shards"}, **small)
    write_config(workspace / "run.yaml", config)
    assert expected in one_error(run_cli("validate", "--config", "run.yaml", cwd=workspace))

    manifest = json.loads((shards / MANIFEST_NAME).read_text())
    cases = {
        "../escape.bin": "shards[0].file: '../escape.bin' is not a plain file name inside the "
        "shard directory",
        "/etc/passwd": "shards[0].file: '/etc/passwd' is not a plain file name",
        "index.json": "shards[0].file: 'index.json' is reserved for the directory's own files",
    }
    for name, text in cases.items():
        manifest["shards"][0]["file"] = name
        (shards / MANIFEST_NAME).write_text(json.dumps(manifest))
        message = one_error(_fit(workspace, {"tokens": "shards"}))
        assert f"shards/index.json: {text}" in message, message
    (shards / MANIFEST_NAME).write_text("{")
    assert "shards/index.json: not JSON (" in one_error(_fit(workspace, {"tokens": "shards"}))
    (shards / MANIFEST_NAME).unlink()
    message = one_error(_fit(workspace, {"tokens": "shards"}))
    assert message.startswith(
        "speedtronic: error: data.tokens: shards has no index.json: not a directory written by "
        "speedtronic prepare"
    )
    # Each source of a mixture is named by its key, in validate as in fit.
    mixture = {"mixture": [{"tokens": "other"}, {"tokens": "nowhere"}]}
    prepared(workspace, "other")
    write_config(workspace / "run.yaml", run_config(workspace / "run", mixture))
    assert one_error(run_cli("validate", "--config", "run.yaml", cwd=workspace)) == (
        "speedtronic: error: data.mixture[1].tokens: nowhere is not a directory of token "
        "shards (make one with speedtronic prepare)"
    )


def test_evaluation_needs_held_out_shards(workspace: Path) -> None:
    prepared(workspace, "no-eval", "--eval-fraction", "0")
    message = one_error(_fit(workspace, {"tokens": "no-eval"}, eval={"every_steps": 1}))
    assert "no-eval has no held-out shards (prepared with --eval-fraction 0)" in message
