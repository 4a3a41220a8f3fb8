"""Property tests of the parsers that take untrusted input (issue 12, fuzzing): the run
config (YAML text and ``--set`` strings), the checkpoint pointer ``latest.json``, and (issue
22) a sharded checkpoint's ``.metadata`` and ``manifest.json`` -- arbitrary bytes, flipped
and cut files, and DCP metadata whose records and entries are made hostile, with the
manifest and pointer rewritten to match so that nothing but the parser stands in the way.

Property: every input gives a valid object or the project's own error with a message --
never another exception -- in bounded time. Derandomized (the same examples every run, no
example database), a few hundred examples each, so CI stays fast and deterministic.
"""

from __future__ import annotations

import dataclasses
import io
import json
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
from speedtronic.config.loading import apply_overrides, parse_yaml
from speedtronic.engine.trainer import TrainingStateError
from speedtronic.state.checkpoint import CheckpointError, CheckpointManager, Pointer, parse_pointer
from speedtronic.state.dcp_io import METADATA_NAME
from speedtronic.state.resume import resume_from
from speedtronic.state.sharded_checkpoint import MANIFEST_NAME, verify_sharded

EXAMPLES = 300
BOUND_S = 5.0  # per example, generous for a loaded CI machine; typical is milliseconds

fuzz = settings(
    derandomize=True,
    database=None,
    max_examples=EXAMPLES,
    deadline=None,  # the bound is asserted per example below, with a clear message
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def within_bound(start: float, what: object) -> None:
    elapsed = time.perf_counter() - start
    assert elapsed < BOUND_S, f"{elapsed:.2f} s for {what!r:.200}"


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
    start = time.perf_counter()
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
    start = time.perf_counter()
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
    start = time.perf_counter()
    try:
        apply_overrides({"run": {"max_steps": 3}, "callbacks": [{"name": "jsonl"}]}, sets)
    except ConfigError as exc:
        assert str(exc)
    within_bound(start, sets)


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
    start = time.perf_counter()
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
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            loaded = checkpoints.load_latest_checkpoint()
        except CheckpointError as exc:
            assert str(exc)
        else:
            assert loaded is not None and loaded.step in (1, 3)
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
    start = time.perf_counter()
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
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as caught:
        verify_sharded(checkpoint, None)
    assert str(caught.value)
    within_bound(start, planted)
