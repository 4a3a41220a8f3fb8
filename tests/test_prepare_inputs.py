"""Issue 36, item 5 through the CLI: several paths per ``--input`` (what an unquoted glob
becomes), a binary file called binary, ``--doc-separator`` for files of many documents, and
``--input-format`` for files whose names say nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from cli_runner import CliResult, run_cli

from speedtronic.data import read_manifest

EOS = 256  # the byte tokenizer's end-of-document id


def prepare_cli(cwd: Path, *args: str) -> CliResult:
    return run_cli("prepare", *args, "--tokenizer", "bytes", "--eval-fraction", "0", cwd=cwd)


def one_error(done: CliResult) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("speedtronic: error: "), done.stderr
    return lines[0]


def shard_documents(directory: Path) -> list[bytes]:
    """The documents in a byte-tokenizer shard set, in order."""
    shards = read_manifest(directory).shards
    ids = np.concatenate([np.fromfile(directory / shard.file, dtype="<u2") for shard in shards])
    ends = np.flatnonzero(ids == EOS).tolist()
    assert ends and ends[-1] == len(ids) - 1
    starts = [0, *(end + 1 for end in ends[:-1])]
    return [bytes(ids[start:end].astype(np.uint8)) for start, end in zip(starts, ends, strict=True)]


def test_one_input_takes_several_paths_as_an_unquoted_glob_gives_them(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.txt").write_text(f"text of {name}\n")
    done = prepare_cli(tmp_path, "--input", "a.txt", "b.txt", "--input", "c.txt", "--output", "out")
    assert done.returncode == 0, done.stderr
    assert shard_documents(tmp_path / "out") == [b"text of a\n", b"text of b\n", b"text of c\n"]


def test_a_binary_file_is_called_binary(tmp_path: Path) -> None:
    (tmp_path / "blob.txt").write_bytes(b"\x00\x01\x02\xff\xfe binary")
    (tmp_path / "blob.jsonl").write_bytes(b'{"text": "a"}\n\x00\x00\xff\n')
    message = one_error(prepare_cli(tmp_path, "--input", "blob.txt", "--output", "out"))
    assert message.endswith("blob.txt: binary data, not text (a NUL byte at byte 0)")
    message = one_error(prepare_cli(tmp_path, "--input", "blob.jsonl", "--output", "out"))
    assert message.endswith("blob.jsonl:2: binary data, not text (a NUL byte at byte 14)")


def test_doc_separator_splits_a_text_file_into_documents(tmp_path: Path) -> None:
    (tmp_path / "fortunes.txt").write_text("one\ntwo\n%\nthree\n%\n%\n  \n%\nfour")
    done = prepare_cli(
        tmp_path, "--input", "fortunes.txt", "--output", "out", "--doc-separator", "%"
    )
    assert done.returncode == 0, done.stderr
    assert shard_documents(tmp_path / "out") == [b"one\ntwo\n", b"three\n", b"four"]
    (tmp_path / "para.txt").write_text("first para\nstill first\n\n\nsecond\n \nthird\n")
    done = prepare_cli(tmp_path, "--input", "para.txt", "--output", "blank", "--doc-separator", "")
    assert done.returncode == 0, done.stderr
    assert shard_documents(tmp_path / "blank") == [
        b"first para\nstill first\n",
        b"second\n",
        b"third\n",
    ]
    assert read_manifest(tmp_path / "blank").documents == 3


def test_input_format_reads_files_whatever_their_names(tmp_path: Path) -> None:
    rows = tmp_path / "rows"
    rows.mkdir()
    (rows / "part-0").write_text(json.dumps({"text": "alpha"}) + "\n")
    (rows / "part-1").write_text(json.dumps({"text": "beta"}) + "\n")
    (rows / ".hidden").write_text("not json\n")
    message = one_error(prepare_cli(tmp_path, "--input", "rows/part-0", "--output", "out"))
    assert "name its format with --input-format" in message
    done = prepare_cli(tmp_path, "--input", "rows", "--output", "out", "--input-format", "jsonl")
    assert done.returncode == 0, done.stderr
    assert shard_documents(tmp_path / "out") == [b"alpha", b"beta"]
