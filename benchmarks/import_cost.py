"""What ``import speedtronic; speedtronic.Trainer`` costs over ``import torch``.

Baseline: a fresh interpreter that imports torch and nothing else -- what any PyTorch script
pays before its first line. Each round starts both interpreters (the order alternating from
round to round) and reads their CPU time (user + system, from ``os.wait4``), which the other
jobs of a shared machine disturb far less than wall time; the report gives the paired
difference's median, the difference of the best-of-N times, and which modules of the config
machinery the import pulled in.

    python benchmarks/import_cost.py --rounds 15
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence

BASELINE = "import torch"
VARIANTS = {
    "speedtronic.Trainer": "import torch, speedtronic; speedtronic.Trainer",
    "speedtronic.engine Trainer": "import torch; from speedtronic.engine.trainer import Trainer",
}
# Modules that belong to reading a config, not to training; none should load here.
CONFIG_MACHINERY = ("jsonschema", "yaml", "speedtronic.config")


def cpu_seconds(code: str) -> float:
    """CPU time of a fresh interpreter running ``code`` (one thread, as the tests run)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-c", code], env=env)
    _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"import_cost: {code!r} failed")
    return usage.ru_utime + usage.ru_stime


def loaded_machinery(code: str) -> list[str]:
    probe = f"{code}\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    names = json.loads(
        subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, check=True
        ).stdout
    )
    return [name for name in CONFIG_MACHINERY if name in names]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    print(f"import cost over `{BASELINE}` (CPU s, {args.rounds} rounds, load {load:.1f})")
    print("| import | paired median | best of N | config machinery loaded |")
    print("|---|---|---|---|")
    for name, code in VARIANTS.items():
        differences, baseline_times, variant_times = [], [], []
        for round_index in range(args.rounds):
            pair = (BASELINE, code) if round_index % 2 == 0 else (code, BASELINE)
            times = {item: cpu_seconds(item) for item in pair}
            differences.append(times[code] - times[BASELINE])
            baseline_times.append(times[BASELINE])
            variant_times.append(times[code])
        machinery = ", ".join(loaded_machinery(code)) or "none"
        print(
            f"| `{name}` | +{statistics.median(differences):.3f} s | "
            f"+{min(differences):.3f} s | {machinery} |"
        )


if __name__ == "__main__":
    main()
