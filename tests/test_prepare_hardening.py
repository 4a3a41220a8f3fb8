"""Issue 30, the data side: what ``prepare`` may replace, files that would block, dead and
stuck tokenizing workers, a tokenizer that panics, documents too long to hold, token ids
beyond the vocabulary, shards linked from elsewhere and shards replaced under a run.

Each case runs the real CLI (in process through ``cli_runner``, or in a forked child where a
process must be killed or must hold something), with real FIFOs (``os.mkfifo``), real worker
processes (found with ``psutil``) and a real ``tokenizers`` regex that panics.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from cli_runner import CliResult, run_cli
from forked import Forked, cli_main
from token_data import documents, run_config, tree_bytes, write_config, write_jsonl

import speedtronic.data.corpus as corpus_module
import speedtronic.data.prepare as prepare_module
from speedtronic.data import read_manifest
from speedtronic.data.corpus import Segment
from speedtronic.data.shards import MANIFEST_NAME

EXIT_USAGE = 2
EXIT_FAILED = 1
pytestmark = pytest.mark.timeout(120)  # a regression here is a hang: let it fail, not stall


def prepare_cli(cwd: Path, *args: str) -> CliResult:
    return run_cli("prepare", *args, cwd=cwd)


def one_error(done: CliResult, code: int = EXIT_USAGE) -> str:
    """The single ``speedtronic: error:`` line of a failure."""
    assert done.returncode == code, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("speedtronic: error: "), done.stderr
    return lines[0]


def hidden(directory: Path) -> list[str]:
    """Leftovers: staging, set-aside and temporary directories."""
    return sorted(path.name for path in directory.iterdir() if path.name.startswith("."))


@pytest.fixture()
def workspace(tmp_path: Path) -> Path:
    write_jsonl(tmp_path / "corpus" / "a.jsonl", documents(40, seed=3))
    return tmp_path


def prepared(workspace: Path, output: str = "shards", *extra: str) -> Path:
    done = prepare_cli(
        workspace, "--input", "corpus", "--tokenizer", "bytes", "--output", output,
        "--shard-tokens", "800", "--eval-fraction", "0.1", *extra,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return workspace / output


def fit(
    workspace: Path, data: dict[str, object], command: str = "fit", run: str = "run"
) -> CliResult:
    config = run_config(workspace / run, data, model={"vocab_size": 257})
    write_config(workspace / "run.yaml", config)
    extra = ("--max-steps", "2") if command == "fit" else ()
    return run_cli(command, "--config", "run.yaml", *extra, cwd=workspace)


# -- 1: --overwrite replaces only a shard set prepare wrote ----------------------------------


def test_overwrite_refuses_a_directory_holding_more_than_its_manifest_lists(
    workspace: Path,
) -> None:
    app = workspace / "app"
    (app / "src").mkdir(parents=True)
    (app / "src" / "main.py").write_text("print('mine')\n")
    (app / "README.md").write_text("mine\n")
    (app / MANIFEST_NAME).write_text('{"name": "app", "version": "1.0"}\n')
    before = tree_bytes(app)
    args = ["--input", "corpus", "--tokenizer", "bytes", "--output", "app", "--overwrite"]
    message = one_error(prepare_cli(workspace, *args))
    assert (
        "--output app: --overwrite replaces only a directory of token shards written by "
        "prepare (one with index.json), and this one is not (" in message
    )
    assert tree_bytes(app) == before

    # A real shard set with something of the user's beside it: named, and kept.
    shards = prepared(workspace)
    (shards / "notes.md").write_text("keep me\n")
    (shards / "extra").mkdir()
    before = tree_bytes(shards)
    args[-2] = "shards"
    message = one_error(prepare_cli(workspace, *args))
    assert message.endswith(
        "--output shards: --overwrite would delete 2 entries that its index.json does not "
        "list (extra/, notes.md); it replaces only a shard set written by prepare: move them "
        "out or choose another --output"
    )
    assert tree_bytes(shards) == before and (shards / "extra").is_dir()
    (shards / "notes.md").unlink()
    (shards / "extra").rmdir()
    assert prepare_cli(workspace, *args).returncode == 0
    assert hidden(workspace) == []


# -- weak spots: --output that cannot be a shard directory ---------------------------------------


def test_an_output_that_is_a_link_dot_or_under_a_file_is_one_error_leaving_nothing(
    workspace: Path,
) -> None:
    (workspace / "real").mkdir()
    (workspace / "link").symlink_to("real")
    (workspace / "dangling").symlink_to("gone")
    (workspace / "afile").write_text("x")
    cases = {
        "link": "--output link: a symbolic link (to real); name the directory itself",
        "dangling": "--output dangling: a symbolic link (to gone, which does not exist); name "
        "the directory itself",
        ".": "--output .: name the shard directory itself",
        "..": "--output ..: name the shard directory itself",
        "afile/shards": "--output afile/shards: afile is not a directory",
        "afile/a/b": "--output afile/a/b: afile is not a directory",
    }
    for output, expected in cases.items():
        for extra in ([], ["--overwrite"]):
            args = ["--input", "corpus", "--tokenizer", "bytes", "--output", output, *extra]
            message = one_error(prepare_cli(workspace, *args))
            assert expected in message, (output, message)
    assert hidden(workspace) == []
    assert sorted(path.name for path in workspace.iterdir()) == [
        "afile", "corpus", "dangling", "link", "real",
    ]  # fmt: skip
    assert list((workspace / "real").iterdir()) == []


def test_a_failed_prepare_removes_the_parent_directories_it_made(workspace: Path) -> None:
    (workspace / "bad.jsonl").write_text('{"text": "fine"}\n{broken\n')
    args = ["--input", "bad.jsonl", "--tokenizer", "bytes", "--output", "new/deep/shards"]
    assert "bad.jsonl:2: malformed JSON" in one_error(prepare_cli(workspace, *args))
    assert sorted(path.name for path in workspace.iterdir()) == ["bad.jsonl", "corpus"]


# -- 6: FIFOs and devices are refused, never waited on -----------------------------------------


def test_a_fifo_manifest_is_refused_by_fit_and_validate(workspace: Path) -> None:
    shards = prepared(workspace)
    (shards / MANIFEST_NAME).unlink()
    os.mkfifo(shards / MANIFEST_NAME)
    for command in ("fit", "validate"):
        message = one_error(fit(workspace, {"tokens": "shards"}, command))
        assert message.endswith(
            "data.tokens: shards/index.json: a FIFO (named pipe), not a regular file; it must "
            "be the manifest written by prepare"
        ), message


def test_a_fifo_tokenizer_shard_or_corpus_file_is_named_not_a_regular_file(
    workspace: Path,
) -> None:
    os.mkfifo(workspace / "tok.json")
    message = one_error(
        prepare_cli(workspace, "--input", "corpus", "--tokenizer", "tok.json", "--output", "x")
    )
    assert message.endswith("tokenizer tok.json: a FIFO (named pipe), not a regular file")
    os.mkfifo(workspace / "corpus" / "b.jsonl")
    message = one_error(
        prepare_cli(workspace, "--input", "corpus/b.jsonl", "--tokenizer", "bytes", "--output", "x")
    )
    assert message.endswith("--input corpus/b.jsonl: not a regular file")
    assert not (workspace / "x").exists() and hidden(workspace) == []

    (workspace / "corpus" / "b.jsonl").unlink()
    shards = prepared(workspace)
    message = one_error(fit(workspace, {"tokens": "shards", "tokenizer": "tok.json"}))
    assert message.endswith("data.tokenizer: 'tok.json' is not a file")  # fit's preflight
    (shards / "train-00000.bin").unlink()
    os.mkfifo(shards / "train-00000.bin")
    message = one_error(fit(workspace, {"tokens": "shards"}))
    assert message.endswith("shards/train-00000.bin: not a regular file; prepare the shards again")


def test_a_fifo_as_a_text_file_is_refused_where_it_is_opened(tmp_path: Path) -> None:
    from speedtronic.data import DataSourceError, TextFileTokenDataset
    from speedtronic.data.text import held_out_cut, read_text_chunks

    fifo = tmp_path / "eval.txt"
    os.mkfifo(fifo)
    expected = re.escape(f"{fifo}: a FIFO (named pipe), not a regular file")
    with pytest.raises(DataSourceError, match="^" + expected):
        TextFileTokenDataset(fifo, block_size=4)
    with pytest.raises(DataSourceError, match="^" + expected):
        next(read_text_chunks(fifo, 1024))
    with pytest.raises(DataSourceError, match="^" + expected):
        held_out_cut(fifo, 0.5)


# -- 8: a dead worker ends prepare ----------------------------------------------------------------


def stalled_prepare(ready: str, go: str, *argv: str) -> int:
    """A forked child: ``speedtronic prepare *argv`` whose reading stalls after the first
    file until ``go`` exists (the workers are up by then), so a test can kill one."""
    real = corpus_module.read_segments

    def stalling(path: Path, *args: Any, **kwargs: Any) -> Iterator[Segment]:
        yield from real(path, *args, **kwargs)
        Path(ready).touch()
        while not Path(go).exists():
            time.sleep(0.01)

    setattr(prepare_module, "read_segments", stalling)  # noqa: B010  # the child's own copy
    return cli_main("prepare", *argv)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_killed_worker_is_an_error_naming_it_and_leaves_nothing(
    workspace: Path, forked: Forked, tmp_path: Path, workers: str, tokenizer_file: Path
) -> None:
    ready, go = tmp_path / "ready", tmp_path / "go"
    args = ["--input", "corpus", "--tokenizer", str(tokenizer_file), "--output", "shards"]
    child = forked.start(
        stalled_prepare, str(ready), str(go), *args, "--workers", workers, cwd=workspace
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert child.poll() is None, child.output
        assert time.monotonic() < deadline, child.output
        time.sleep(0.02)
    tokenizing = psutil.Process(child.pid).children()
    assert len(tokenizing) == int(workers)
    victim = tokenizing[-1].pid
    os.kill(victim, signal.SIGKILL)
    while tokenizing[-1].is_running() and tokenizing[-1].status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.01)  # dead before prepare reads on (a loaded machine may take a while)
    go.touch()
    assert child.wait(60) == EXIT_FAILED, child.output
    assert f" of {workers} (pid {victim}) killed by SIGKILL; nothing was written" in child.output
    assert "Traceback" not in child.output
    assert not (workspace / "shards").exists() and hidden(workspace) == []
    assert all(not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
               for process in tokenizing)  # fmt: skip


# -- 9: a tokenizer that panics, or takes too long ----------------------------------------------

CATASTROPHIC = "a" * 30 + "b"
"""Text on which the regex ``(a+)+$`` exceeds Oniguruma's backtracking limit: a Rust panic."""


@pytest.fixture()
def tokenizer_file(tmp_path: Path) -> Path:
    """A word-level tokenizer with an end-of-text token (no training needed)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    path = tmp_path / "plain.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture()
def catastrophic(tmp_path: Path) -> Path:
    """A tokenizer whose pre-tokenizer regex panics on ``CATASTROPHIC``."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("(a+)+$"), "isolated")
    tokenizer.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    path = tmp_path / "regex.json"
    tokenizer.save(str(path))
    return path


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_tokenizer_that_panics_is_one_error_naming_the_file_and_the_document(
    tmp_path: Path, catastrophic: Path, workers: str
) -> None:
    write_jsonl(tmp_path / "docs.jsonl", ["a b", "b a a", CATASTROPHIC, "a"])
    args = ["--input", "docs.jsonl", "--tokenizer", "regex.json", "--output", "out"]
    message = one_error(prepare_cli(tmp_path, *args, "--workers", workers))
    assert message == (
        "speedtronic: error: regex.json: the tokenizer failed on docs.jsonl:3 (Onig: Regex "
        "search error: retry-limit-in-match over)"
    )
    assert not (tmp_path / "out").exists() and hidden(tmp_path) == []


def test_a_tokenizer_over_the_time_bound_is_one_error_naming_the_documents(
    tmp_path: Path, catastrophic: Path
) -> None:
    write_jsonl(tmp_path / "docs.jsonl", [CATASTROPHIC * 4])
    args = ["--input", "docs.jsonl", "--tokenizer", "regex.json", "--output", "out"]
    message = one_error(
        prepare_cli(tmp_path, *args, "--workers", "2", "--tokenize-timeout", "0.01")
    )
    assert message == (
        "speedtronic: error: regex.json: the tokenizer did not finish within 0.01 s "
        "(--tokenize-timeout) on docs.jsonl:1: a pre-tokenizer regex that backtracks, or a "
        "very long document?"
    )
    assert not (tmp_path / "out").exists() and hidden(tmp_path) == []


def test_fit_with_a_tokenizer_that_panics_names_it_and_the_text_file(
    tmp_path: Path, catastrophic: Path
) -> None:
    (tmp_path / "data.txt").write_text("a b a\n" + CATASTROPHIC + "\n")
    config = run_config(tmp_path / "run", {"text_path": "data.txt", "tokenizer": "regex.json"})
    write_config(tmp_path / "run.yaml", config)
    done = run_cli("fit", "--config", "run.yaml", "--max-steps", "2", cwd=tmp_path)
    message = one_error(done)
    assert message.startswith(
        "speedtronic: error: regex.json: the tokenizer failed (Onig: Regex search error: "
        "retry-limit-in-match over) on data.txt (the text before byte "
    ), message


# -- 11: a document too long to hold ------------------------------------------------------------


def test_a_document_over_the_bound_is_refused_or_split_as_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    words = documents(1, seed=5, low=400, high=400)[0]
    write_jsonl(tmp_path / "docs.jsonl", ["short one", words, "after"])
    args = ["--input", "docs.jsonl", "--tokenizer", "bytes", "--output", "out",
            "--eval-fraction", "0", "--max-document-bytes", "1000"]  # fmt: skip
    message = one_error(prepare_cli(tmp_path, *args))
    assert message.startswith(
        "speedtronic: error: docs.jsonl:2: a line of more than 1,000 bytes "
        "(--max-document-bytes); pass --long-documents split"
    ), message
    assert not (tmp_path / "out").exists() and hidden(tmp_path) == []

    monkeypatch.setattr(corpus_module, "TEXT_CHUNK_BYTES", 300)  # pieces of about 300 bytes
    assert prepare_cli(tmp_path, *args, "--long-documents", "split").returncode == 0
    manifest = read_manifest(tmp_path / "out")
    assert manifest.documents == 3  # the long one is still one document
    tokens = np.fromfile(tmp_path / "out" / "train-00000.bin", dtype="<u2")
    expected = b"short one\x00" + words.encode() + b"\x00" + b"after\x00"
    eos = np.flatnonzero(tokens == 256)
    assert eos.tolist() == [i for i, byte in enumerate(expected) if byte == 0]
    assert bytes(np.where(tokens == 256, 0, tokens).astype(np.uint8)) == expected


def test_a_huge_jsonl_line_is_never_read_whole(tmp_path: Path) -> None:
    line = b'{"text": "' + b"x" * (32 << 20) + b'"}\n'
    (tmp_path / "huge.jsonl").write_bytes(b'{"text": "a"}\n' + line)
    tracemalloc.start()
    try:
        done = prepare_cli(
            tmp_path, "--input", "huge.jsonl", "--tokenizer", "bytes", "--output", "out",
            "--max-document-bytes", str(1 << 20),
        )  # fmt: skip
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "huge.jsonl:2: a line of more than 1,048,576 bytes" in one_error(done)
    assert peak < 8 << 20, f"{peak:,} bytes at the peak"
    assert hidden(tmp_path) == []


def test_only_a_bom_or_whitespace_is_no_document(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "bom.txt").write_bytes(b"\xef\xbb\xbf")
    (tmp_path / "c" / "blank.txt").write_bytes(b"\xef\xbb\xbf  \n\t\n")
    write_jsonl(tmp_path / "c" / "rows.jsonl", ["  ", "\n"])
    args = ["--input", "c", "--tokenizer", "bytes", "--output", "out", "--eval-fraction", "0"]
    message = one_error(prepare_cli(tmp_path, *args))
    assert message.startswith("speedtronic: error: empty corpus: the input(s) hold no text")
    (tmp_path / "c" / "text.txt").write_text("  words\n")
    assert prepare_cli(tmp_path, *args).returncode == 0
    assert read_manifest(tmp_path / "out").documents == 1


# -- 12: token ids beyond the vocabulary ---------------------------------------------------------


def test_a_shard_with_ids_beyond_the_vocabulary_is_refused_before_the_first_step(
    workspace: Path,
) -> None:
    shards = prepared(workspace)
    manifest = json.loads((shards / MANIFEST_NAME).read_text())
    assert all(0 < shard["max_id"] <= 256 for shard in manifest["shards"])
    shard = shards / "train-00000.bin"
    tokens = np.fromfile(shard, dtype="<u2")
    assert int(tokens.max()) == manifest["shards"][0]["max_id"]
    tokens[5] = 300  # beyond the byte tokenizer's 257 ids, still a uint16
    tokens.tofile(shard)
    manifest["shards"][0]["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    for recorded in (True, False):  # the attacker rewrote max_id too / an older manifest
        if recorded:
            manifest["shards"][0]["max_id"] = 256
        else:
            del manifest["shards"][0]["max_id"]
        (shards / MANIFEST_NAME).write_text(json.dumps(manifest))
        message = one_error(fit(workspace, {"tokens": "shards"}))
        assert message.endswith(
            "data.tokens: shards/train-00000.bin: holds token id 300, outside index.json's "
            "vocabulary of 257 ids (0-256): the shard was altered after prepare; prepare the "
            "shards again"
        ), message
        assert not (workspace / "run" / "metrics.jsonl").exists()


def test_a_manifest_without_max_ids_still_trains_and_a_wrong_one_is_refused(
    workspace: Path,
) -> None:
    shards = prepared(workspace)
    manifest = json.loads((shards / MANIFEST_NAME).read_text())
    for shard in manifest["shards"]:
        del shard["max_id"]
    (shards / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert fit(workspace, {"tokens": "shards"}).returncode == 0
    manifest["shards"][0]["max_id"] = 7
    (shards / MANIFEST_NAME).write_text(json.dumps(manifest))
    message = one_error(fit(workspace, {"tokens": "shards"}, run="again"))
    assert "shards/train-00000.bin: its largest token id is " in message
    assert "index.json records 7: the shard was modified" in message


# -- 13: shards from elsewhere, and shards replaced under a run ----------------------------------


def test_a_shard_linked_from_outside_its_directory_is_refused(workspace: Path) -> None:
    shards = prepared(workspace)
    shard = shards / "train-00000.bin"
    outside = workspace / "elsewhere.bin"
    outside.write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(outside)
    message = one_error(fit(workspace, {"tokens": "shards"}))
    assert message.endswith(
        f"data.tokens: shards/train-00000.bin: a link to {outside}, outside shards: shards are "
        "read only from inside their own directory; copy the file in, or prepare the shards "
        "again"
    ), message


def test_overwrite_refuses_a_shard_set_a_running_fit_is_reading(
    workspace: Path, forked: Forked
) -> None:
    shards = prepared(workspace)
    before = tree_bytes(shards)
    config = run_config(
        workspace / "run", {"tokens": "shards"}, model={"vocab_size": 257},
        run={"max_steps": 1_000_000}, checkpoint={"enabled": False},
    )  # fmt: skip
    write_config(workspace / "run.yaml", config)
    run = forked.start(cli_main, "fit", "--config", "run.yaml", cwd=workspace)
    metrics = workspace / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert run.poll() is None and time.monotonic() < deadline, run.output
        time.sleep(0.05)
    args = ["--input", "corpus", "--tokenizer", "bytes", "--output", "shards", "--overwrite"]
    message = one_error(prepare_cli(workspace, *args, "--shard-tokens", "300"))
    assert message.endswith(
        "--output shards: a run is reading these shards (fit or evaluate holds "
        "shards/index.json); --overwrite replaces them only when no run reads them: wait for "
        "it to end, or write to another --output"
    )
    assert tree_bytes(shards) == before and hidden(workspace) == []
    assert run.poll() is None, run.output  # still training, on the same shards
    run.send_signal(signal.SIGTERM)
    assert run.wait(60) in (143, -signal.SIGTERM), run.output  # its lock goes with it
    assert prepare_cli(workspace, *args, "--shard-tokens", "300").returncode == 0
    assert read_manifest(shards).shard_tokens == 300
