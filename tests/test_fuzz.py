"""Property tests of the parsers that take untrusted input (issue 12, fuzzing): the run
config (YAML text and ``--set`` strings, and its limits on text size, values and number
length: issue 22), the checkpoint pointer ``latest.json``, (issue 23) the token-shard
manifest ``index.json``, and (issue 22) a sharded checkpoint's ``.metadata`` and
``manifest.json`` -- arbitrary bytes, flipped and cut files, and DCP metadata whose records
and entries are made hostile, with the manifest and pointer rewritten to match so that
nothing but the parser stands in the way.

Property: every input gives a valid object or the project's own error with a message --
never another exception -- in bounded time. Derandomized (the same examples every run, no
example database), a few hundred examples each, so CI stays fast and deterministic.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import re
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planted_payloads import rehash
from test_fsdp import make_trainer
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from speedtronic.config import ConfigError, SpeedtronicConfig, load_config
from speedtronic.config.loading import MAX_NODES, MAX_TEXT_BYTES, apply_overrides, parse_yaml
from speedtronic.config.schema import MAX_NUMBER_CHARS
from speedtronic.engine.trainer import TrainingStateError
from speedtronic.state.checkpoint import CheckpointError, CheckpointManager, Pointer, parse_pointer
from speedtronic.state.dcp_io import METADATA_NAME
from speedtronic.state.resume import resume_from
from speedtronic.state.sharded_checkpoint import MANIFEST_NAME, verify_sharded

EXAMPLES = 300
BOUND_S = 5.0  # CPU seconds per example: a guard against runaway (superlinear) parsing, not a
# speed check -- CPU time, so a loaded machine's waiting does not count; typical is milliseconds

fuzz = settings(
    derandomize=True,
    database=None,
    max_examples=EXAMPLES,
    deadline=None,  # the bound is asserted per example below, with a clear message
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def within_bound(start: float, what: object) -> None:
    elapsed = time.process_time() - start
    assert elapsed < BOUND_S, f"{elapsed:.2f} CPU s for {what!r:.200}"


# -- input strategies -------------------------------------------------------------------------

YAML_TOKENS = [
    "[", "]", "{", "}", ": ", ":", "- ", ",", "\n", "  ", "    ", "&a ", "*a", "&b ", "*b",
    "<<: ", "? ", "|\n", ">\n", "# c\n", "'", '"', "!!binary ", "!!python/object:os.system ",
    "!!int ", "!!float ", "!!timestamp ", "!!set ", "!!omap ", "2001-13-45", "1e5", "3e-4",
    ".nan", "-.inf", "0x1F", "0o17", "1_000", "null", "~", "true", "NO", "x", "run", "model",
    "optimizer", "lr", "max_steps", "callbacks", "name", "checkpoint", "every_steps", "9" * 40,
    "\t", "\x00", "\ufeff", "%YAML 1.1\n", "---\n", "...\n",
]  # fmt: skip
SECTION_KEYS = [
    "run", "model", "data", "optimizer", "scheduler", "checkpoint", "logging", "callbacks",
    "precision", "distributed", "imports", "compile", "max_steps",
]  # fmt: skip

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
plain_data = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from(SECTION_KEYS) | st.text(max_size=8), inner, max_size=4),
    ),
    max_leaves=20,
)
token_soup = st.lists(st.sampled_from(YAML_TOKENS), max_size=40).map("".join)
yaml_text = st.one_of(
    st.text(max_size=200),
    token_soup,
    plain_data.map(lambda data: json.dumps(data, default=str)),
    st.dictionaries(st.sampled_from(SECTION_KEYS), plain_data, max_size=5).map(
        lambda data: json.dumps(data, default=str)
    ),
)
override_keys = st.one_of(
    st.text(max_size=30),
    st.lists(
        st.sampled_from(
            [
                "run",
                "max_steps",
                "optimizer",
                "lr",
                "callbacks",
                "[0]",
                "[99]",
                ".",
                "[",
                "]",
                "name",
                "betas",
                "[1]",
                "model",
                "x",
            ]
        ),  # fmt: skip
        max_size=6,
    ).map("".join),
)
overrides = st.lists(
    st.tuples(override_keys, st.sampled_from(["=", "", "=="]), yaml_text).map("".join),
    max_size=3,
)


# -- the run config ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="speedtronic-fuzz-") as directory:
        yield Path(directory)


@fuzz
@given(text=yaml_text)
def test_yaml_text_gives_data_or_a_config_error(text: str) -> None:
    start = time.process_time()
    try:
        parse_yaml(text)
    except ConfigError as exc:
        assert str(exc)
    within_bound(start, text)


@fuzz
@given(text=yaml_text, sets=overrides)
def test_config_file_and_set_strings_give_a_config_or_a_config_error(
    workdir: Path, text: str, sets: list[str]
) -> None:
    path = workdir / "run.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    start = time.process_time()
    try:
        config = load_config(path, overrides=sets)
    except ConfigError as exc:
        assert str(exc)
    else:
        assert isinstance(config, SpeedtronicConfig)
    within_bound(start, (text, sets))


@fuzz
@given(sets=overrides)
def test_set_strings_on_a_valid_config_give_data_or_a_config_error(sets: list[str]) -> None:
    start = time.process_time()
    try:
        apply_overrides({"run": {"max_steps": 3}, "callbacks": [{"name": "jsonl"}]}, sets)
    except ConfigError as exc:
        assert str(exc)
    within_bound(start, sets)


# -- the config text limits (issue 22): long numbers, many values, long text -----------------

number_literals = st.tuples(
    st.sampled_from(["", "-", "+"]),
    st.sampled_from(["", "0x", "0b", "0o", "0"]),
    st.text(alphabet="0123456789abcdef_:.e", min_size=1, max_size=30),
    st.integers(min_value=0, max_value=6000),  # how often the digits repeat
).map(lambda parts: parts[0] + parts[1] + parts[2] * max(1, parts[3] // len(parts[2])))
NUMBER_KEYS = ["run.seed", "optimizer.lr", "model.n_layer", "data.dataset_options.n", "extra"]


@fuzz
@given(literal=number_literals, key=st.sampled_from(NUMBER_KEYS), as_json=st.booleans())
def test_any_number_literal_anywhere_gives_a_config_or_a_short_config_error(
    workdir: Path, literal: str, key: str, as_json: bool
) -> None:
    *sections, name = key.split(".")
    if as_json:
        if not literal.lstrip("-").isdigit() or literal.startswith("+"):
            literal = "".join(c for c in literal if c.isdigit()) or "0"
        literal = literal.lstrip("0") or "0"  # JSON integers have no leading zeros
        body = f'{{"{name}": {literal}}}'
        for section in reversed(sections):
            body = f'{{"{section}": {body}}}'
        path = workdir / "number.json"
    else:
        body = "".join(f"{'  ' * depth}{section}:\n" for depth, section in enumerate(sections))
        body += f"{'  ' * len(sections)}{name}: {literal}\n"
        path = workdir / "number.yaml"
    path.write_text(body)
    start = time.process_time()
    try:
        load_config(path)
    except ConfigError as exc:
        message = str(exc)
        assert message and len(message) < 2000, message[:300]  # never every digit
        decimal = re.fullmatch(r"[-+]?[1-9][0-9_]*", literal) is not None  # an int in YAML
        if decimal and len(literal) > MAX_NUMBER_CHARS:
            assert f"{key}: " in message and "out of range" in message
    within_bound(start, literal)


@settings(fuzz, max_examples=6)  # each parses up to MAX_NODES values: about 0.5 s
@given(
    values=st.integers(min_value=MAX_NODES // 2 - 50, max_value=MAX_NODES // 2 + 50),
    padding=st.sampled_from([0, MAX_TEXT_BYTES]),
    flow=st.booleans(),
)
def test_documents_at_the_limits_are_parsed_or_refused_saying_which(
    values: int, padding: int, flow: bool
) -> None:
    # ``values`` keys are 2 * values nodes (a key and its value) plus the root mapping.
    items = [f"k{i}: {i}" for i in range(values)]
    text = ("{" + ", ".join(items) + "}" if flow else "\n".join(items)) + "\n"
    text += "# " + "x" * max(0, padding - len(text) - 3) + "\n" if padding else ""
    start = time.process_time()
    try:
        parsed = parse_yaml(text)
    except ConfigError as exc:
        too_many = 2 * values + 1 > MAX_NODES
        too_long = len(text) > MAX_TEXT_BYTES
        assert too_many or too_long, str(exc)
        limit = f"{MAX_TEXT_BYTES:,}" if too_long else f"more than {MAX_NODES:,} values"
        assert limit in str(exc) and "alias" not in str(exc)
    else:
        assert isinstance(parsed, dict) and len(parsed) == values
        assert 2 * values + 1 <= MAX_NODES and len(text) <= MAX_TEXT_BYTES
    within_bound(start, (values, padding))


# -- the checkpoint pointer ---------------------------------------------------------------------

STEP_NAMES = ["step_000000000001.pt", "step_000000000003.pt", "step_000000000009.pt",
              "../step_000000000001.pt", "latest.json", "step_1.pt"]  # fmt: skip
pointer_objects = st.recursive(
    scalars | st.sampled_from(STEP_NAMES) | st.just("a" * 64),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.sampled_from(["file", "step", "checkpoints", "sha256", "loss", "finite_loss"])
            | st.sampled_from(STEP_NAMES),
            inner,
            max_size=4,
        ),
    ),
    max_leaves=16,
)
pointer_bytes = st.one_of(
    st.binary(max_size=300),
    pointer_objects.map(lambda value: json.dumps(value).encode("utf-8")),
    st.integers(min_value=1, max_value=50_000).map(lambda depth: b"[" * depth + b"]" * depth),
    st.fixed_dictionaries(
        {"file": st.sampled_from(STEP_NAMES), "step": scalars, "checkpoints": pointer_objects}
    ).map(lambda value: json.dumps(value).encode("utf-8")),
)


@pytest.fixture(scope="module")
def checkpoints(workdir: Path) -> CheckpointManager:
    manager = CheckpointManager(workdir / "checkpoints", keep_last=None)
    for step in (1, 3):
        manager.save(step, {"weights": torch.full((4,), float(step))})
    return manager


@fuzz
@given(data=pointer_bytes)
def test_pointer_bytes_give_a_pointer_or_a_stated_problem(
    checkpoints: CheckpointManager, data: bytes
) -> None:
    start = time.process_time()
    pointer, problem = parse_pointer(data, checkpoints._validate_pointer)
    assert isinstance(pointer, Pointer)
    assert problem is None or (isinstance(problem, str) and problem)
    assert problem is not None or pointer.target is not None
    within_bound(start, data)


@settings(fuzz, max_examples=100)
@given(data=pointer_bytes)
def test_resume_with_any_pointer_loads_a_checkpoint_or_says_why(
    checkpoints: CheckpointManager, data: bytes
) -> None:
    checkpoints.pointer_path.write_bytes(data)
    start = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            loaded = checkpoints.load_latest_checkpoint()
        except CheckpointError as exc:
            assert str(exc)
        else:
            assert loaded is not None and loaded.step in (1, 3)
    within_bound(start, data)


# -- the token-shard manifest (issue 23) ------------------------------------------------------

SHARD_NAMES = ["train-00000.bin", "eval-00000.bin", "../escape.bin", "/etc/passwd", ".hidden",
               "index.json", "tokenizer.json", "a/b.bin", "x" * 300, ""]  # fmt: skip
MANIFEST_KEYS = ["format", "version", "dtype", "vocab_size", "eos_id", "tokenizer", "documents",
                 "tokens", "eval_fraction", "shard_tokens", "shards", "file", "split", "sha256",
                 "kind", "max_id"]  # fmt: skip
SHARD_TOKENS = 40
SHARD_IDS = [(index * 37) % 299 for index in range(SHARD_TOKENS)]  # ids 0..298 of 300
SHARD_BYTES = b"".join(token.to_bytes(2, "little") for token in SHARD_IDS)
SHARD_SHA256 = hashlib.sha256(SHARD_BYTES).hexdigest()
SHARD_MAX_ID = max(SHARD_IDS)
VALID_MANIFEST = {
    "format": "speedtronic-token-shards", "version": 1, "dtype": "uint16", "vocab_size": 300,
    "eos_id": 0, "tokenizer": {"kind": "bytes", "sha256": "a" * 64, "file": None},
    "documents": 3, "tokens": SHARD_TOKENS, "eval_fraction": 0.0, "shard_tokens": 100,
    "shards": [{"file": "train-00000.bin", "split": "train", "tokens": SHARD_TOKENS,
                "sha256": SHARD_SHA256, "max_id": SHARD_MAX_ID}],
}  # fmt: skip
manifest_values = st.recursive(
    scalars | st.sampled_from(SHARD_NAMES) | st.sampled_from(["uint16", "uint32", "train", "eval",
                                                              "a" * 64, "bytes"]),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(MANIFEST_KEYS), inner, max_size=5),
    ),
    max_leaves=16,
)  # fmt: skip


DELETE = object()


def _mutated(changes: list[tuple[list[str], object]]) -> bytes:
    """The valid manifest with the value at each key path replaced or (``DELETE``) removed;
    a path through the shard list goes into its first shard."""
    data = json.loads(json.dumps(VALID_MANIFEST))
    for path, value in changes:
        target: object = data
        for key in path[:-1]:
            target = target.get(key) if isinstance(target, dict) else None
            if isinstance(target, list):
                target = target[0] if target else None
        if not isinstance(target, dict):
            continue
        if value is DELETE:
            target.pop(path[-1], None)
        else:
            target[path[-1]] = value
    return json.dumps(data).encode("utf-8")


key_paths = st.lists(st.sampled_from(MANIFEST_KEYS), min_size=1, max_size=3)
manifest_bytes = st.one_of(
    st.just(json.dumps(VALID_MANIFEST).encode("utf-8")),
    st.binary(max_size=300),
    manifest_values.map(lambda value: json.dumps(value).encode("utf-8")),
    st.integers(min_value=1, max_value=50_000).map(
        lambda depth: b'{"a":' * depth + b"1" + b"}" * depth
    ),
    st.lists(st.tuples(key_paths, manifest_values | st.just(DELETE)), min_size=1, max_size=4).map(
        _mutated
    ),
)


@pytest.fixture(scope="module")
def shard_directory(workdir: Path) -> Path:
    directory = workdir / "shards"
    directory.mkdir()
    (directory / "train-00000.bin").write_bytes(SHARD_BYTES)
    return directory


@fuzz
@given(data=manifest_bytes)
def test_manifest_bytes_give_a_manifest_or_a_manifest_error(
    shard_directory: Path, data: bytes
) -> None:
    from speedtronic.data.shards import (
        ManifestError,
        ShardError,
        TokenManifest,
        parse_manifest,
        verify_shards,
    )

    start = time.process_time()
    try:
        manifest = parse_manifest(data, "index.json")
    except ManifestError as exc:
        assert str(exc).startswith("index.json: ")
    else:
        assert isinstance(manifest, TokenManifest)
        for shard in manifest.shards:  # every name stays inside the directory
            assert (shard_directory / shard.file).resolve().parent == shard_directory.resolve()
        try:
            verify_shards(shard_directory, manifest, manifest.shards, checksums=True)
        except ShardError as exc:
            assert str(exc).startswith(str(shard_directory))
        else:  # what training may then read: the bytes the manifest describes, ids it allows
            for shard in manifest.shards:
                assert shard.sha256 == SHARD_SHA256
                assert SHARD_MAX_ID < manifest.vocab_size
                assert shard.max_id in (None, SHARD_MAX_ID)
    within_bound(start, data)


# -- sharded (DCP) checkpoints: .metadata and manifest.json ---------------------------------------


@pytest.fixture(scope="module")
def sharded(workdir: Path) -> dict[str, bytes]:
    """A one-process FSDP run's sharded checkpoint in ``workdir/sharded`` (step 5, the only
    one): the original bytes of its ``.metadata`` and ``manifest.json``, put back by each
    example before it plants its own."""
    make_trainer("fsdp", directory=workdir / "sharded").fit(5)
    newest = workdir / "sharded" / "step_000000000005.dcp"
    return {name: (newest / name).read_bytes() for name in (METADATA_NAME, MANIFEST_NAME)}


def plant_sharded(workdir: Path, originals: dict[str, bytes], name: str, data: bytes) -> Path:
    """``data`` as the checkpoint's file ``name``, the other one original; with
    ``rehash`` the manifest and the pointer are rewritten to match (as an attacker would)."""
    checkpoint = workdir / "sharded" / "step_000000000005.dcp"
    for original, content in originals.items():
        (checkpoint / original).write_bytes(data if original == name else content)
    if name == METADATA_NAME:
        rehash(checkpoint)
    return checkpoint


def resumes_or_says_why(checkpoint: Path, what: object) -> None:
    """A resume from ``checkpoint``'s directory loads it or raises the project's own error
    with a message, within the bound, and nothing planted runs."""
    trainer = make_trainer("fsdp")
    start = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            resumed = resume_from(trainer, CheckpointManager(checkpoint.parent))
        except (CheckpointError, TrainingStateError) as exc:
            assert str(exc)
        else:
            assert resumed == checkpoint and trainer.step == 5
    within_bound(start, what)


def metadata_bytes(metadata: Metadata) -> bytes:
    buffer = io.BytesIO()
    torch.save(metadata, buffer)
    return buffer.getvalue()


tricky_values = st.one_of(
    plain_data,
    st.sampled_from(
        ["../../etc/passwd", "/etc/passwd", "__0_0.distcp", "__1_0.distcp", "state.pt",
         ".metadata", "manifest.json", "a\x00b", "__0_0.distcp/..", "", ".", ".."]
    ),  # fmt: skip
    st.integers(min_value=-(2**70), max_value=2**70),
    st.lists(st.integers(min_value=-5, max_value=2**40), max_size=4).map(torch.Size),
    st.just(["zstd"]),
)
metadata_fields = st.sampled_from(["relative_path", "offset", "length", "transform_descriptors"])
top_fields = st.sampled_from(
    ["state_dict_metadata", "storage_data", "storage_meta", "planner_data", "version"]
)


mutations = st.lists(
    st.tuples(
        st.sampled_from(["storage", "entry", "chunk", "drop", "top"]),
        st.integers(min_value=0, max_value=10**6),  # which record, entry or chunk
        metadata_fields,
        top_fields,
        st.one_of(st.just(BytesStorageMetadata()), tricky_values),
        st.lists(st.integers(min_value=-3, max_value=2**40), min_size=2, max_size=2),
    ),
    min_size=1,
    max_size=3,
)


def mutated_metadata(original: bytes, plan: list[tuple[Any, ...]]) -> bytes:
    """The checkpoint's own ``.metadata`` with ``plan``'s fields made hostile: where a
    record lies, what an entry is, a chunk's bounds, a record dropped, a whole table."""
    metadata = read_metadata_bytes(original)
    for kind, which, field, top, value, sizes in plan:
        tables = metadata.storage_data, metadata.state_dict_metadata
        storage, entries = (list(t.items()) if isinstance(t, dict) else [] for t in tables)
        tensors = [e for _, e in entries if isinstance(e, TensorStorageMetadata) and e.chunks]
        if kind == "storage" and storage:
            index, info = storage[which % len(storage)]
            metadata.storage_data[index] = dataclasses.replace(info, **{field: value})
        elif kind == "entry" and entries:
            metadata.state_dict_metadata[entries[which % len(entries)][0]] = value
        elif kind == "chunk" and tensors:
            entry = tensors[which % len(tensors)]
            bounds = torch.Size(sizes[: len(entry.chunks[0].sizes)])
            entry.chunks[0] = dataclasses.replace(entry.chunks[0], sizes=bounds)
        elif kind == "drop" and storage:
            del metadata.storage_data[storage[which % len(storage)][0]]
        elif kind == "top":
            setattr(metadata, top, value)
    return metadata_bytes(metadata)


def read_metadata_bytes(data: bytes) -> Metadata:
    """A fresh copy of the metadata in ``data`` (test code: the file is this test's own)."""
    from speedtronic.state.dcp_io import _metadata_classes

    with torch.serialization.safe_globals(_metadata_classes()):
        metadata = torch.load(io.BytesIO(data), weights_only=True)
    assert isinstance(metadata, Metadata)
    return metadata


@settings(fuzz, max_examples=60)
@given(
    damage=st.one_of(
        mutations.map(lambda plan: ("mutate", plan)),
        st.binary(max_size=2000).map(lambda data: ("replace", data)),
        st.tuples(st.floats(0, 1), st.integers(1, 255)).map(lambda flip: ("flip", flip)),
        st.floats(0, 1).map(lambda cut: ("cut", cut)),
    )
)
def test_any_dcp_metadata_resumes_or_gives_a_checkpoint_error(
    workdir: Path, sharded: dict[str, bytes], damage: tuple[str, Any]
) -> None:
    original = sharded[METADATA_NAME]
    kind, how = damage
    if kind == "mutate":
        planted = mutated_metadata(original, how)
    elif kind == "replace":
        planted = how
    elif kind == "flip":
        at = int(how[0] * (len(original) - 1))
        planted = original[:at] + bytes([original[at] ^ how[1]]) + original[at + 1 :]
    else:
        planted = original[: int(how * len(original))]
    resumes_or_says_why(plant_sharded(workdir, sharded, METADATA_NAME, planted), damage)


MANIFEST_ENTRIES = [".metadata", "state.pt", "__0_0.distcp", "__1_0.distcp", "../state.pt",
                    "/etc/passwd", "a\x00b", "", ".", "..", "x" * 300, "manifest.json"]  # fmt: skip
manifest_objects = st.recursive(
    scalars | st.sampled_from(MANIFEST_ENTRIES),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.sampled_from(["format", "files", "size", "sha256", "world_size"])
            | st.sampled_from(MANIFEST_ENTRIES),
            inner,
            max_size=5,
        ),
    ),
    max_leaves=20,
)


@settings(fuzz, max_examples=150)
@given(
    planted=st.one_of(
        st.binary(max_size=400),
        manifest_objects.map(lambda value: json.dumps(value).encode("utf-8")),
        st.integers(min_value=1, max_value=50_000).map(lambda d: b"[" * d + b"]" * d),
    )
)
def test_any_dcp_manifest_gives_a_checkpoint_error(
    workdir: Path, sharded: dict[str, bytes], planted: bytes
) -> None:
    checkpoint = plant_sharded(workdir, sharded, MANIFEST_NAME, planted)
    start = time.process_time()
    with pytest.raises(CheckpointError) as caught:
        verify_sharded(checkpoint, None)
    assert str(caught.value)
    within_bound(start, planted)
