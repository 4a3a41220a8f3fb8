"""The token-shard loader's cost per batch in machine instructions, against the bare
``np.memmap`` gather of ``benchmarks/data.py`` (``gather_loop``), counted by callgrind.

The wall-clock comparison (``data.py --gather-only``) moves with the load of a shared
machine; instruction counts do not. Each case runs in its own process under
``valgrind --tool=callgrind`` (``loop_instructions.py``'s harness: uninstrumented imports,
collection only inside two markers), over the same shard set and the same windows in the
same order (the loader's): ``functools.reduce`` wraps FIRST batches and ``sorted`` SECOND
batches after a warm-up, and the count per batch is the difference over the extra batches,
so setup cancels out. Cases:

  gather    ``data.gather_batch``: one memmap per shard kept open, one fancy index of the
            batch within one shard (one slice per window into the batch when it spans
            shards), one ``astype(int64)``, ``input_ids``/``labels`` views of it
  loader    ``next()`` of the default ``data.tokens`` loader's iterator (``FastLoader``:
            sampler, batching, fetch, the gather with its block accounting, the tensors)

Instructions are user-space work only: the kernel's page faults and ``madvise`` calls, and
the time memory traffic takes, are not in them (the wall-clock run has those). The shard
set is 256 MiB of random ``uint16`` tokens (4 shards), made once outside valgrind.

    python benchmarks/data_instructions.py                   # block 128 and 1024
    python benchmarks/data_instructions.py --baseline REV    # and the loader of commit REV
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
BLOCKS = (128, 1024)
FIRST, SECOND = 64, 320
WARM_UP = 64
SET_BYTES = 256 << 20


def batches(directory: Path, case: str, block: int) -> Callable[[int], None]:
    """A function that reads the next ``n`` batches of ``case``."""
    import numpy as np

    import speedtronic  # noqa: F401  # from PYTHONPATH (a --baseline tree), before data.py's own

    sys.path.insert(0, str(HERE))
    from data import BATCH, build_dataloader, data_config, gather_batch, gather_views, window_plan

    if case == "loader":
        iterator = iter(build_dataloader(data_config(directory, block=block)))  # type: ignore[arg-type]

        def run_loader(count: int) -> None:
            for _ in range(count):
                next(iterator)

        return run_loader
    total = (WARM_UP + FIRST + SECOND) * BATCH
    plan = window_plan(directory, total, block=block)
    rows = iter([plan[begin : begin + BATCH] for begin in range(0, total, BATCH)])
    views, span = gather_views(directory), np.arange(block + 1)

    def run_gather(count: int) -> None:
        for chosen in itertools.islice(rows, count):
            gather_batch(views, chosen, span)

    return run_gather


def child(directory: str, case: str, block: str) -> None:
    """Inside valgrind: warm up, then FIRST batches in one marker and SECOND in the other."""
    import torch

    torch.set_num_threads(1)
    run = batches(Path(directory), case, int(block))
    helper = os.environ.get("LOOP_INSTRUCTIONS_HELPER")
    if helper:
        import ctypes

        ctypes.CDLL(helper).start_instrumentation()
    run(WARM_UP)
    gc.collect()
    gc.freeze()  # a full collection of torch's objects must not land in one marker only
    functools.reduce(lambda _a, _b: run(FIRST), [0, 0])
    sorted([0, 1], key=lambda a: (run(SECOND) or 0) if a else 0)


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(*sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", metavar="REV", help="also count the loader of commit REV")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("needs valgrind (apt install valgrind)")
    sys.path.insert(0, str(HERE))
    from data import make_token_set
    from loop_instructions import MARKERS, export_revision, inclusive_counts, start_callgrind

    with tempfile.TemporaryDirectory(prefix="speedtronic-data-instructions-") as tmp:
        work = Path(tmp)
        shards = make_token_set(work / "shards", SET_BYTES)
        sources = {"": HERE.parent}
        if args.baseline:
            sources[args.baseline] = export_revision(args.baseline, work)
        runs = {}
        for block in BLOCKS:
            runs[(block, "gather", "")] = HERE.parent
            for revision, source in sources.items():
                runs[(block, "loader", revision)] = source
        outs = {key: work / f"callgrind.{index}" for index, key in enumerate(runs)}
        per_batch: dict[tuple[int, str, str], float] = {}
        for key, source in runs.items():  # one at a time: two cores, other jobs beside
            block, case, _ = key
            process = start_callgrind(
                __file__, [str(shards), case, str(block)], MARKERS, outs[key], source
            )
            if process.wait() != 0:
                sys.exit(f"a valgrind run failed (exit {process.returncode})")
            counts = inclusive_counts(outs[key])
            per_batch[key] = (counts["builtin_sorted"] - counts["functools_reduce"]) / (
                SECOND - FIRST
            )
    print("| block | case | instructions per batch | over the gather |")
    print("|---|---|---:|---:|")
    for block in BLOCKS:
        base = per_batch[(block, "gather", "")]
        for (shown, case, revision), count in per_batch.items():
            if shown == block:
                label = f"loader at {revision}" if revision else case
                print(f"| {block} | {label} | {count:,.0f} | {count / base:.2f}x |")


if __name__ == "__main__":
    main()
