"""The background worker's submit on the metric sinks' path, against a bare ``deque.append``.

The TensorBoard and W&B sinks hand each record to ``speedtronic.util.worker.BackgroundWorker``
(``when_full="wait"``, ``interval_s=0.1``) on the training thread. The strongest hand-written
alternative is what that submit is meant to be: one ``deque.append`` that a thread drains
every 0.1 s. Both run the same loop of records with a worker thread draining concurrently
(the GIL time that thread takes shows up on the submitting side); cases are interleaved,
alternating which goes first, and the table gives the median and best ns per record.

    python benchmarks/worker_submit.py            # 100,000 records, 9 rounds
    python benchmarks/worker_submit.py --records 20000 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable

from speedtronic.util.worker import BackgroundWorker


def _handle(item: int) -> None:
    del item


def bare_deque(records: int) -> float:
    """``deque.append`` drained every 0.1 s by a thread: the baseline."""
    pending: deque[int] = deque()
    stop = threading.Event()

    def drain() -> None:
        while not stop.wait(0.1):
            while pending:
                _handle(pending.popleft())

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    started = time.perf_counter()
    for item in range(records):
        pending.append(item)
    elapsed = time.perf_counter() - started
    stop.set()
    thread.join()
    return elapsed / records * 1e9


def worker(records: int) -> float:
    sink: BackgroundWorker[int] = BackgroundWorker("bench", _handle, interval_s=0.1)
    sink.submit(-1)  # the thread is running before the clock starts, as in a fit
    started = time.perf_counter()
    for item in range(records):
        sink.submit(item)
    elapsed = time.perf_counter() - started
    sink.close()
    return elapsed / records * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    cases: dict[str, Callable[[int], float]] = {
        "deque.append (baseline)": bare_deque,
        "BackgroundWorker.submit": worker,
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(args.rounds):
        order = list(cases) if round_ % 2 == 0 else list(reversed(cases))
        for name in order:
            times[name].append(cases[name](args.records))
    print("| case | median ns/record | best ns/record |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.0f} | {min(values):.0f} |")


if __name__ == "__main__":
    main()
