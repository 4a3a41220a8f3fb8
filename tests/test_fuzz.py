"""Property tests of the parsers that take untrusted input (issue 12, fuzzing): the run
config (YAML text and ``--set`` strings, and its limits on text size, values and number
length: issue 22) and the checkpoint pointer ``latest.json``.

Property: every input gives a valid object or the project's own error with a message --
never another exception -- in bounded time. Derandomized (the same examples every run, no
example database), a few hundred examples each, so CI stays fast and deterministic.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speedtronic.config import ConfigError, SpeedtronicConfig, load_config
from speedtronic.config.loading import MAX_NODES, MAX_TEXT_BYTES, apply_overrides, parse_yaml
from speedtronic.config.schema import MAX_NUMBER_CHARS
from speedtronic.state.checkpoint import CheckpointError, CheckpointManager, Pointer, parse_pointer

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
    start = time.perf_counter()
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
    start = time.perf_counter()
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


# -- the token-shard manifest (issue 23) ------------------------------------------------------

SHARD_NAMES = ["train-00000.bin", "eval-00000.bin", "../escape.bin", "/etc/passwd", ".hidden",
               "index.json", "tokenizer.json", "a/b.bin", "x" * 300, ""]  # fmt: skip
MANIFEST_KEYS = ["format", "version", "dtype", "vocab_size", "eos_id", "tokenizer", "documents",
                 "tokens", "eval_fraction", "shard_tokens", "shards", "file", "split", "sha256",
                 "kind"]  # fmt: skip
SHARD_TOKENS = 40
VALID_MANIFEST = {
    "format": "speedtronic-token-shards", "version": 1, "dtype": "uint16", "vocab_size": 300,
    "eos_id": 0, "tokenizer": {"kind": "bytes", "sha256": "a" * 64, "file": None},
    "documents": 3, "tokens": SHARD_TOKENS, "eval_fraction": 0.0, "shard_tokens": 100,
    "shards": [{"file": "train-00000.bin", "split": "train", "tokens": SHARD_TOKENS,
                "sha256": "b" * 64}],
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
    (directory / "train-00000.bin").write_bytes(b"\x01\x00" * SHARD_TOKENS)
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

    start = time.perf_counter()
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
    within_bound(start, data)
