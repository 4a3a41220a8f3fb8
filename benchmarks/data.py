"""Real-data throughput (issue 23): the token-shard loader and ``speedtronic prepare``.

Loader. A 1 GB shard set of random ``uint16`` tokens (4 shards) in a temporary directory;
every case reads the same windows in the same order (``block_size + 1 = 1025`` tokens,
batches of 8, the first WINDOWS windows of the loader's shuffled order) into ``int64``
``input_ids``/``labels``:

  bare, nanoGPT   nanoGPT's ``get_batch``: ``np.memmap`` re-created every batch (what keeps
                  its memory flat), ``torch.stack`` of ``from_numpy(slice.astype(int64))``
  bare, one map   the same slicing with one ``np.memmap`` per shard kept open for the run
                  (the mapped pages of every window read stay in the RSS)
  bare, one map, released at 32 MiB   the same, unmapping what it mapped as the loader
                  does (``madvise(MADV_DONTNEED)`` of the 2 MiB blocks it read, once they
                  add up to 32 MiB): the bare loop with the loader's flat memory
  speedtronic     ``build_dataloader`` of ``data.tokens`` (``DataLoader``, no workers),
                  built before the clock starts: ``WindowSampler`` order, one gather per
                  batch, what was mapped released before it passes 32 MiB
  speedtronic, maps kept   the same dataset with ``resident_bytes`` unbounded
  os.preadv       not a memmap, for reference: each window read from the file into the
                  batch (nothing is mapped, so nothing faults and the RSS stays flat)

Against the strongest bare baseline (``gather_lines``, also alone with ``--gather-only``):
the default loader and ``gather_loop`` -- one memmap per shard kept open, a batch fetched by
one fancy index of ``starts[:, None] + np.arange(block + 1)`` (one slice per window when the
batch spans shards, the cheaper way there), one ``astype(int64)``, no DataLoader, no memory
bound -- over the same windows in the loader's order, at block 128 and 1024, rotated rounds,
tokens/s and the reading thread's CPU time per batch, paired by round. The same comparison
in instructions per batch (which the machine's load does not move):
``benchmarks/data_instructions.py``.

The windows are read in two orders, every case in both:

  local           the loader's order: 2 MiB chunks of windows in a seeded order, the
                  windows of every 8 consecutive chunks (a working set) dealt in a seeded
                  order of their own (``speedtronic.data.windows.ChunkedPermutation``)
  global          for reference, the order the loader had before: one seeded permutation
                  of all windows (nearly every window lands on a 2 MiB block not read for
                  long, so a loop with flat memory maps nearly every window anew)

The "released" loop counted 2 MiB per window before; it now counts the distinct blocks read,
as the loader does (the same thing in the global order, where nearly every window is a new
block). Rounds run the cases in ABBA order; besides best and median tokens/s, the ratios are
paired round by round (the load of a shared machine moves between rounds more than within
one).

Then one whole epoch (all ~524k windows, 1 GB) in the loader's order through the default
loader and through the one-map loop, sampling the process RSS (psutil) every 256 batches:
the growth is what stays mapped. On kernels with large folios (Linux 6.x), one touched window
maps a 2 MiB folio, so the one-map loop's RSS grows to the size of the shard set although
nothing is copied.

Smoke model: ``configs/smoke.yaml`` trained for a few dozen steps on this CPU, its
tokens/s against the loader's at the same batch shape (block 32, micro-batch 8).

Prepare. A JSONL corpus (random-word documents) and a BPE tokenizer trained on part of it:
``speedtronic prepare`` with ``--workers 1`` and ``--workers 2`` against ``tokenizers``' own
``encode_batch`` (and ``encode_batch_fast``, the faster of the two is the baseline) over the
same documents held in memory, single-threaded (``TOKENIZERS_PARALLELISM=false``, as every
prepare process runs); plus ``encode_batch`` on all cores for reference. Rounds interleave
the cases; the tables show best and median tokens/s of ROUNDS rounds.

Shard verification: ``verify_shards`` (sha256 of each shard) over the 1 GB set.

    python benchmarks/data.py              # prints tables; --markdown for docs
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import mmap
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import psutil
import torch
import yaml
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speedtronic.config import load_config  # noqa: E402
from speedtronic.data import build_dataloader  # noqa: E402
from speedtronic.data.loader import DEFAULT_DATA_SEED  # noqa: E402
from speedtronic.data.prepare import PrepareOptions, prepare  # noqa: E402
from speedtronic.data.shards import (  # noqa: E402
    _DIGESTS,
    MANIFEST_NAME,
    ShardEntry,
    TokenizerRecord,
    TokenManifest,
    read_manifest,
    verify_shards,
)
from speedtronic.data.tokenizer import BYTE_TOKENIZER_SHA256  # noqa: E402
from speedtronic.data.windows import (  # noqa: E402
    DEFAULT_RESIDENT_BYTES,
    FAULT_BYTES,
    TokenWindowDataset,
    WindowSampler,
)
from speedtronic.runtime import build_runtime  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GIGABYTE = 1 << 30
SHARDS = 4
BLOCK = 1024
BATCH = 8
WINDOWS = 16384
ROUNDS = 5
CORPUS_DOCS = 24_000


# -- the shard set ----------------------------------------------------------------------------


def make_token_set(directory: Path, total_bytes: int = GIGABYTE) -> Path:
    """Random uint16 shards and their manifest, written as ``speedtronic prepare`` would."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per_shard = total_bytes // 2 // SHARDS
    entries = []
    for index in range(SHARDS):
        tokens = rng.integers(0, 50_000, per_shard, dtype=np.uint16)
        path = directory / f"train-{index:05d}.bin"
        tokens.tofile(path)
        digest = hashlib.sha256(tokens.tobytes()).hexdigest()
        entries.append(ShardEntry(path.name, "train", per_shard, digest))
    manifest = TokenManifest(
        dtype="uint16",
        vocab_size=50_257,
        eos_id=50_256,
        tokenizer=TokenizerRecord("bytes", BYTE_TOKENIZER_SHA256, None),
        documents=1,
        eval_fraction=0.0,
        shard_tokens=per_shard,
        shards=tuple(entries),
    )
    (directory / MANIFEST_NAME).write_text(manifest.to_json())
    return directory


def data_config(directory: Path, block: int = BLOCK, batch: int = BATCH) -> object:
    return load_config(
        {
            "data": {"tokens": str(directory), "micro_batch_size": batch, "block_size": block},
            "model": {"vocab_size": 50_257, "max_seq_len": block},
        }
    ).data


def rss() -> int:
    return int(psutil.Process().memory_info().rss)


# -- loader cases -----------------------------------------------------------------------------


Plan = list[tuple[int, int]]
"""``(shard, token offset)`` of each window read, in order."""


def window_plan(directory: Path, count: int, *, local: bool = True, block: int = BLOCK) -> Plan:
    """The first ``count`` windows of the loader's order (``local``), or of one seeded
    permutation of all windows (the loader's order before chunks: ``WindowSampler`` with
    ``chunk=1``), as ``(shard, token offset)``."""
    loader = build_dataloader(data_config(directory, block=block))  # type: ignore[arg-type]
    dataset = loader.dataset
    assert isinstance(dataset, TokenWindowDataset)
    sampler = loader.sampler if local else global_sampler(dataset)
    assert isinstance(sampler, WindowSampler)
    order = list(sampler)[:count]
    starts = dataset._starts
    shards = np.searchsorted(starts, order, side="right") - 1
    return [(int(s), int((w - starts[s]) * block)) for s, w in zip(shards, order, strict=True)]


def global_sampler(dataset: TokenWindowDataset) -> WindowSampler:
    """The order the loader had before chunks: one keyed permutation of every window."""
    return WindowSampler(len(dataset), shuffle=True, seed=DEFAULT_DATA_SEED)


def shard_paths(directory: Path) -> list[Path]:
    return [directory / shard.file for shard in read_manifest(directory).shards]


def bare_loop(
    directory: Path,
    plan: Plan,
    *,
    remap_every_batch: bool,
    release_bytes: int | None = None,
) -> int:
    """nanoGPT's ``get_batch`` over ``plan``; with ``remap_every_batch`` its memmaps are made
    anew for every batch (as nanoGPT does), else kept open for the whole loop; with
    ``release_bytes``, the 2 MiB blocks the windows read are unmapped
    (``madvise(MADV_DONTNEED)`` of each) once there are that many bytes of them, as the
    loader does."""
    paths = shard_paths(directory)
    kept: dict[int, np.memmap] = {}
    blocks: set[tuple[int, int]] = set()
    limit = (release_bytes or 0) // FAULT_BYTES
    tokens = 0
    for begin in range(0, len(plan), BATCH):
        maps: dict[int, np.memmap] = {} if remap_every_batch else kept
        xs, ys = [], []
        for shard, offset in plan[begin : begin + BATCH]:
            data = maps.get(shard)
            if data is None:
                data = maps[shard] = np.memmap(paths[shard], dtype=np.uint16, mode="r")
            xs.append(torch.from_numpy(data[offset : offset + BLOCK].astype(np.int64)))
            ys.append(torch.from_numpy(data[offset + 1 : offset + 1 + BLOCK].astype(np.int64)))
            if release_bytes is not None:
                first = offset * 2 // FAULT_BYTES
                last = ((offset + BLOCK + 1) * 2 - 1) // FAULT_BYTES
                new = {(shard, block) for block in range(first, last + 1)} - blocks
                if new and len(blocks) + len(new) > limit:
                    for mapped_shard, block in blocks:
                        raw = maps[mapped_shard]._mmap  # type: ignore[attr-defined]
                        start = block * FAULT_BYTES
                        raw.madvise(mmap.MADV_DONTNEED, start, min(FAULT_BYTES, len(raw) - start))
                    blocks.clear()
                blocks |= new
        x, y = torch.stack(xs), torch.stack(ys)
        tokens += x.numel()
        del y
    return tokens


def pread_loop(directory: Path, plan: Plan) -> int:
    """Not ``np.memmap`` (for reference): each window read from the file with
    ``os.preadv`` into the batch, which maps nothing (the RSS stays flat without faults)."""
    files = [os.open(path, os.O_RDONLY) for path in shard_paths(directory)]
    tokens = 0
    try:
        for begin in range(0, len(plan), BATCH):
            rows = plan[begin : begin + BATCH]
            windows = np.empty((len(rows), BLOCK + 1), dtype=np.uint16)
            for row, (shard, offset) in enumerate(rows):
                os.preadv(files[shard], [memoryview(windows[row]).cast("B")], offset * 2)
            x = torch.from_numpy(windows[:, :-1].astype(np.int64))
            y = torch.from_numpy(windows[:, 1:].astype(np.int64))
            tokens += x.numel()
            del y
    finally:
        for handle in files:
            os.close(handle)
    return tokens


def speedtronic_loader(
    directory: Path,
    count: int,
    resident: int | None = None,
    *,
    local: bool = True,
    block: int = BLOCK,
) -> Callable[[], int]:
    """A fresh ``data.tokens`` loader (new maps, like the bare loops' new memmaps), built
    now; the returned function reads its first ``count`` windows (what is timed: building
    validates a config and reads the manifest, a once-per-run cost). Without ``local``, the
    same dataset in the global order (``global_sampler``)."""
    loader = build_dataloader(data_config(directory, block=block))  # type: ignore[arg-type]
    dataset = loader.dataset
    assert isinstance(dataset, TokenWindowDataset)
    if resident is not None:
        dataset._maps.resident_bytes = resident
    if not local:
        loader = DataLoader(
            dataset,
            batch_size=BATCH,
            sampler=global_sampler(dataset),
            collate_fn=dataset.collate_fn,
        )

    def run() -> int:
        tokens = 0
        for index, batch in enumerate(loader):
            tokens += batch["input_ids"].numel()
            if (index + 1) * BATCH >= count:
                break
        return tokens

    return run


def gather_loop(directory: Path, plan: Plan, block: int) -> int:
    """The strongest bare baseline (``GATHER``): one ``np.memmap`` per shard kept open for
    the run; a batch whose windows lie in one shard fetched by one fancy index of its tokens
    with ``starts[:, None] + np.arange(block + 1)``, one that spans shards (the loader's order
    deals the chunks of a working set, which come from any shard) by one slice per window
    into the batch array, the cheaper of the ways to gather from several maps (a fancy index
    per shard, grouping rows with ``np.unique`` or a dict, costs several times more); then
    one ``astype(int64)`` of the batch, ``input_ids``/``labels`` views of it. No
    ``DataLoader``, no collate, no memory bound, no resume: what a user writes for speed
    alone. The memmaps are indexed through their ``ndarray`` views (indexing an ``np.memmap``
    object makes a ``memmap`` instance of every result, a few us more per batch)."""
    views = gather_views(directory)
    span = np.arange(block + 1)
    tokens = 0
    for begin in range(0, len(plan), BATCH):
        x, _ = gather_batch(views, plan[begin : begin + BATCH], span)
        tokens += x.numel()
    return tokens


def gather_views(directory: Path) -> list[np.ndarray]:
    """``gather_loop``'s maps: one ``np.memmap`` per shard, as a plain ``ndarray`` view."""
    return [
        np.memmap(path, dtype=np.uint16, mode="r").view(np.ndarray)
        for path in shard_paths(directory)
    ]


def gather_batch(
    views: list[np.ndarray], rows: Plan, span: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of ``gather_loop``: ``rows`` read with ``span = np.arange(block + 1)``."""
    shards = [shard for shard, _ in rows]
    if shards.count(shards[0]) == len(shards):
        starts = np.array([offset for _, offset in rows])
        windows = views[shards[0]][starts[:, None] + span]
    else:
        width = len(span)
        windows = np.empty((len(rows), width), dtype=np.uint16)
        for row, (shard, offset) in enumerate(rows):
            windows[row] = views[shard][offset : offset + width]
    both = torch.from_numpy(windows.astype(np.int64))
    return both[:, :-1], both[:, 1:]


GATHER = "bare np.memmap gather (one fancy index per batch)"
GATHER_BLOCKS = (128, 1024)


def gather_rounds(
    directory: Path, rounds: int
) -> tuple[dict[int, dict[str, list[float]]], dict[int, dict[str, list[float]]]]:
    """``block -> case -> tokens/s`` and ``block -> case -> CPU us per batch`` of each round:
    the loader against ``gather_loop`` over the same windows in the same order, at each of
    ``GATHER_BLOCKS``, cases in rotated order (round ``r`` starts at case ``r mod n``)."""
    cases: dict[tuple[int, str], Callable[[], Callable[[], int]]] = {}
    for block in GATHER_BLOCKS:
        plan = window_plan(directory, WINDOWS, block=block)
        cases[(block, GATHER)] = lambda plan=plan, block=block: (  # type: ignore[misc]
            lambda: gather_loop(directory, plan, block)
        )
        cases[(block, LOADER)] = lambda block=block: speedtronic_loader(  # type: ignore[misc]
            directory, WINDOWS, block=block
        )
    speed: dict[int, dict[str, list[float]]] = {block: {} for block in GATHER_BLOCKS}
    cpu: dict[int, dict[str, list[float]]] = {block: {} for block in GATHER_BLOCKS}
    keys = list(cases)
    for round_ in range(rounds):
        shift = round_ % len(keys)
        for block, name in keys[shift:] + keys[:shift]:
            run = cases[(block, name)]()
            gc.collect()
            own, start = time.thread_time(), time.perf_counter()
            tokens = run()
            elapsed, used = time.perf_counter() - start, time.thread_time() - own
            speed[block].setdefault(name, []).append(tokens / elapsed)
            cpu[block].setdefault(name, []).append(used / (WINDOWS / BATCH) * 1e6)
    return speed, cpu


def gather_lines(directory: Path, rounds: int) -> Iterator[str]:
    """The loader against the strongest bare baseline, at block 128 and 1024."""
    speed, cpu = gather_rounds(directory, rounds)
    yield (
        f"\nloader vs {GATHER}: {WINDOWS} windows, batches of {BATCH}, local order, "
        f"{rounds} rotated rounds, load {os.getloadavg()[0]:.2f}"
    )
    for block in GATHER_BLOCKS:
        ratios = paired(speed[block][LOADER], speed[block][GATHER])
        cpu_ratios = paired(cpu[block][GATHER], cpu[block][LOADER])
        for name in (GATHER, LOADER):
            values = speed[block][name]
            yield (
                f"  block {block:>4} {name:<50} best {max(values) / 1e6:7.2f} M  median "
                f"{statistics.median(values) / 1e6:7.2f} M tokens/s  CPU "
                f"{min(cpu[block][name]):6.1f} / {statistics.median(cpu[block][name]):6.1f} "
                "us per batch (best / median)"
            )
        yield (
            f"  block {block:>4} loader / baseline tokens/s, paired: median "
            f"{statistics.median(ratios):.2f}x, best {max(ratios):.2f}x; by CPU time: median "
            f"{statistics.median(cpu_ratios):.2f}x, best {max(cpu_ratios):.2f}x"
        )


def timed(run: Callable[[], int], cpu: dict[str, list[float]] | None = None) -> float:
    """Tokens/s of ``run``; with ``cpu``, also the CPU seconds per million tokens of this
    process (all its threads) and of its reaped children (prepare's workers)."""
    gc.collect()
    own, children = time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
    start = time.perf_counter()
    tokens = run()
    elapsed = time.perf_counter() - start
    if cpu is not None:
        cpu["main"].append((time.process_time() - own) / tokens * 1e6)
        worker = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - children
        cpu["workers"].append(worker / tokens * 1e6)
    return tokens / elapsed


LOCAL, GLOBAL = "local order", "global order"
BARE_KEPT = "bare, one map kept"
BARE_RELEASED = "bare, one map, released at 32 MiB"
BARE_NANOGPT = "bare, nanoGPT (re-map every batch)"
LOADER = "speedtronic (default)"
LOADER_KEPT = "speedtronic, maps kept"


def loader_cases(directory: Path, local: bool) -> dict[str, Callable[[], Callable[[], int]]]:
    """The six cases over the first WINDOWS windows of one order (module docstring)."""
    plan = window_plan(directory, WINDOWS, local=local)
    return {
        BARE_NANOGPT: lambda: lambda: bare_loop(directory, plan, remap_every_batch=True),
        BARE_KEPT: lambda: lambda: bare_loop(directory, plan, remap_every_batch=False),
        BARE_RELEASED: lambda: (
            lambda: bare_loop(
                directory, plan, remap_every_batch=False, release_bytes=DEFAULT_RESIDENT_BYTES
            )
        ),
        LOADER: lambda: speedtronic_loader(directory, WINDOWS, local=local),
        LOADER_KEPT: lambda: speedtronic_loader(directory, WINDOWS, 1 << 62, local=local),
        "os.preadv into the batch (not a memmap)": lambda: lambda: pread_loop(directory, plan),
    }


def loader_rounds(directory: Path, rounds: int) -> dict[str, dict[str, list[float]]]:
    """``order -> case -> tokens/s`` of each round, both orders' cases interleaved."""
    cases = {
        (order, name): case
        for order, local in ((LOCAL, True), (GLOBAL, False))
        for name, case in loader_cases(directory, local).items()
    }
    results: dict[str, dict[str, list[float]]] = {LOCAL: {}, GLOBAL: {}}
    for order, name in cases:
        results[order][name] = []
    for round_ in range(rounds):
        keys = list(cases) if round_ % 2 == 0 else list(reversed(cases))  # ABBA
        for order, name in keys:
            results[order][name].append(timed(cases[(order, name)]()))
    return results


def paired(case: list[float], baseline: list[float]) -> list[float]:
    """``case``'s tokens/s over ``baseline``'s, round by round (the load moves between
    rounds more than within one)."""
    return [a / b for a, b in zip(case, baseline, strict=True)]


def epoch_rss(directory: Path) -> dict[str, tuple[float, float]]:
    """``case -> (RSS growth in MB, tokens/s)`` over one whole epoch."""
    found: dict[str, tuple[float, float]] = {}
    loader = build_dataloader(data_config(directory))  # type: ignore[arg-type]
    gc.collect()
    before, peak, tokens = rss(), 0, 0
    start = time.perf_counter()
    for index, batch in enumerate(loader):
        tokens += batch["input_ids"].numel()
        if index % 256 == 0:
            peak = max(peak, rss() - before)
    found["speedtronic (default), 1 epoch"] = (
        max(peak, rss() - before) / 1e6,
        tokens / (time.perf_counter() - start),
    )
    del loader
    gc.collect()
    plan = window_plan(directory, 1 << 62)  # the loader's order
    maps = [np.memmap(path, dtype=np.uint16, mode="r") for path in shard_paths(directory)]
    before, peak, tokens = rss(), 0, 0
    start = time.perf_counter()
    for begin in range(0, len(plan), BATCH):
        rows = [maps[s][o : o + BLOCK].astype(np.int64) for s, o in plan[begin : begin + BATCH]]
        tokens += len(rows) * BLOCK
        if begin % (256 * BATCH) == 0:
            peak = max(peak, rss() - before)
    found["bare, one map kept, 1 epoch"] = (
        max(peak, rss() - before) / 1e6,
        tokens / (time.perf_counter() - start),
    )
    return found


# -- the smoke model ----------------------------------------------------------------------------


def smoke_tokens_per_second(output: Path) -> float:
    config = yaml.safe_load((ROOT / "configs" / "smoke.yaml").read_text())
    config["run"].update(max_steps=60, output_dir=str(output))
    config["checkpoint"] = {"enabled": False}
    config["logging"] = {"every_steps": 1000, "console": False, "jsonl": False}
    trainer, _ = build_runtime(load_config(config))
    start = time.perf_counter()
    result = trainer.fit()
    return result.tokens / (time.perf_counter() - start)


def smoke_shape_loader(directory: Path) -> float:
    config = data_config(directory, block=32, batch=8)
    loader = build_dataloader(config)  # type: ignore[arg-type]
    start, tokens = time.perf_counter(), 0
    for index, batch in enumerate(loader):
        tokens += batch["input_ids"].numel()
        if index == 20_000:
            break
    return tokens / (time.perf_counter() - start)


# -- prepare ------------------------------------------------------------------------------------

WORDS = [
    "".join(random.Random(seed).choice("abcdefghijklmnopqrstuvwxyz") for _ in range(1 + seed % 9))
    for seed in range(3000)
]


def make_corpus(directory: Path) -> tuple[list[Path], list[str]]:
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1)
    texts = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 400))) for _ in range(CORPUS_DOCS)
    ]
    files = []
    for part in range(4):
        path = directory / f"part-{part}.jsonl"
        chunk = texts[part::4]
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in chunk))
        files.append(path)
    return files, [text for part in range(4) for text in texts[part::4]]


def train_tokenizer(texts: list[str], path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts[:2000], trainer)
    tokenizer.save(str(path))
    return path


def encode_all(tokenizer_path: Path, texts: list[str], method: str, parallel: bool) -> int:
    from tokenizers import Tokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = "true" if parallel else "false"
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    encode = getattr(tokenizer, method)
    tokens = 0
    for begin in range(0, len(texts), 1000):
        for encoding in encode(texts[begin : begin + 1000], add_special_tokens=False):
            tokens += len(encoding.ids)
    return tokens


def prepare_rounds(work: Path, cpu: dict[str, dict[str, list[float]]]) -> dict[str, list[float]]:
    files, texts = make_corpus(work)
    tokenizer = train_tokenizer(texts, work / "tokenizer.json")
    outputs = iter(range(1000))

    def run_prepare(workers: int) -> int:
        output = work / f"out-{next(outputs)}"
        options = PrepareOptions(
            inputs=[str(f) for f in files], tokenizer=str(tokenizer), output=output,
            workers=workers, eval_fraction=0.0,
        )  # fmt: skip
        manifest = prepare(options).manifest
        return manifest.tokens - manifest.documents  # without the end-of-document ids

    cases: dict[str, Callable[[], int]] = {
        "encode_batch, 1 thread": lambda: encode_all(tokenizer, texts, "encode_batch", False),
        "encode_batch_fast, 1 thread": lambda: encode_all(
            tokenizer, texts, "encode_batch_fast", False
        ),
        f"encode_batch, all {os.cpu_count()} cores": lambda: encode_all(
            tokenizer, texts, "encode_batch", True
        ),
        "prepare --workers 1": lambda: run_prepare(1),
        "prepare --workers 2": lambda: run_prepare(2),
    }
    results: dict[str, list[float]] = {name: [] for name in cases}
    for name in cases:
        cpu[name] = {"main": [], "workers": []}
    for _ in range(ROUNDS):
        for name, run in cases.items():
            results[name].append(timed(run, cpu[name]))
    os.environ.pop("TOKENIZERS_PARALLELISM", None)
    return results


def verify_seconds_per_gb(directory: Path) -> list[float]:
    manifest = read_manifest(directory)
    times = []
    for _ in range(3):
        _DIGESTS.clear()
        start = time.perf_counter()
        verify_shards(directory, manifest, manifest.shards, checksums=True)
        times.append((time.perf_counter() - start) / (manifest.tokens * 2 / GIGABYTE))
    return times


# -- output ---------------------------------------------------------------------------------


def table(
    title: str, results: dict[str, list[float]], baseline: str, markdown: bool
) -> Iterator[str]:
    base = statistics.median(results[baseline])
    yield f"\n{title}"
    if markdown:
        yield "\n| case | best tokens/s | median tokens/s | median / baseline |"
        yield "|---|---|---|---|"
    for name, values in results.items():
        best, median = max(values), statistics.median(values)
        ratio = median / base
        if markdown:
            yield f"| {name} | {best / 1e6:,.1f} M | {median / 1e6:,.1f} M | {ratio:.2f}x |"
        else:
            yield (
                f"  {name:<40} best {best / 1e6:8.2f} M  median {median / 1e6:8.2f} M  "
                f"{ratio:5.2f}x"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--skip-prepare", action="store_true")
    parser.add_argument("--skip-loader", action="store_true")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="loader rounds (ABBA order)")
    parser.add_argument(
        "--gather-only",
        action="store_true",
        help="only the loader against the bare memmap gather (block 128 and 1024)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="speedtronic-data-bench-") as folder:
        work = Path(folder)
        lines: list[str] = [f"machine: {os.cpu_count()} CPUs, load {os.getloadavg()}"]
        if args.gather_only:
            shards = make_token_set(work / "shards")
            lines += gather_lines(shards, args.rounds)
            lines.append(f"load after: {os.getloadavg()}")
            print("\n".join(lines))
            return
        if not args.skip_loader:
            shards = make_token_set(work / "shards")
            lines += gather_lines(shards, args.rounds)
            orders = loader_rounds(shards, args.rounds)
            for order in (LOCAL, GLOBAL):
                lines += table(
                    f"loader, {order}: {WINDOWS} windows of {BLOCK + 1} tokens, batches of "
                    f"{BATCH}, {args.rounds} rounds",
                    orders[order],
                    BARE_KEPT,
                    args.markdown,
                )
            pairs = (
                ((LOCAL, LOADER), (LOCAL, BARE_KEPT)),
                ((LOCAL, LOADER), (LOCAL, BARE_RELEASED)),
                ((LOCAL, LOADER), (LOCAL, BARE_NANOGPT)),
                ((LOCAL, LOADER_KEPT), (LOCAL, BARE_KEPT)),
                ((LOCAL, LOADER), (GLOBAL, BARE_KEPT)),
                ((LOCAL, LOADER), (GLOBAL, LOADER)),
                ((GLOBAL, LOADER), (GLOBAL, BARE_KEPT)),
            )
            lines.append("\npaired by round:")
            for (order, case), (base_order, baseline) in pairs:
                ratios = paired(orders[order][case], orders[base_order][baseline])
                lines.append(
                    f"  {case} ({order}) / {baseline} ({base_order}): median "
                    f"{statistics.median(ratios):.2f}x, best {max(ratios):.2f}x, worst "
                    f"{min(ratios):.2f}x"
                )
            for name, (growth, rate) in epoch_rss(shards).items():
                lines.append(f"  {name}: RSS growth {growth:.1f} MB, {rate / 1e6:.1f} M tokens/s")
            smoke = smoke_tokens_per_second(work / "smoke")
            shaped = smoke_shape_loader(shards)
            lines.append(
                f"  smoke model: {smoke:,.0f} tokens/s; loader at its shape (block 32, batch 8): "
                f"{shaped:,.0f} tokens/s = {shaped / smoke:,.0f}x"
            )
            verify = verify_seconds_per_gb(shards)
            lines.append(
                f"  verify_shards (sha256): best {min(verify):.2f} s/GB, median "
                f"{statistics.median(verify):.2f} s/GB"
            )
        if not args.skip_prepare:
            cpu: dict[str, dict[str, list[float]]] = {}
            results = prepare_rounds(work / "prepare", cpu)
            faster = max(
                ("encode_batch, 1 thread", "encode_batch_fast, 1 thread"),
                key=lambda name: statistics.median(results[name]),
            )
            lines += table(
                f"prepare: {CORPUS_DOCS} JSONL documents, {ROUNDS} rounds (baseline: {faster})",
                results,
                faster,
                args.markdown,
            )
            lines.append("  CPU s per million tokens (median): this process / worker processes")
            for name, seconds in cpu.items():
                main_s = statistics.median(seconds["main"])
                workers_s = statistics.median(seconds["workers"])
                lines.append(f"    {name:<38} {main_s:6.2f} / {workers_s:6.2f}")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
