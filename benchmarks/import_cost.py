"""What ``import speedtronic; speedtronic.Trainer`` costs over ``import torch``, in CPU time.

Baseline: a fresh interpreter that imports torch and nothing else -- what any PyTorch script
pays before its first line, so the difference is exactly what choosing speedtronic adds.

Every measurement is a fresh interpreter (an import is paid once per process; a warm
``sys.modules`` would measure nothing), its CPU time (user + system) read rather than wall
time, which the other jobs of a shared machine disturb far less. Two figures per variant:

* ``paired``: the whole interpreter's CPU time (``os.wait4``) minus that of the baseline
  interpreter started beside it -- the issue's definition, but carrying the noise of
  interpreter start-up and of torch's own ~1 s import;
* ``in-process``: ``time.process_time()`` read by the interpreter itself just before and just
  after ``import speedtronic; speedtronic.Trainer`` -- the same cost without that noise.

Each is reported twice:

* ``raw``: the import as a script meets it;
* ``GC debt paid``: ``gc.collect()`` right after ``import torch``, in the baseline arm as well
  as in the variant. Importing torch leaves hundreds of thousands of new long-lived objects
  that have not yet been through a full (generation-2) collection; the next full collection
  is due soon after, and it lands in whichever code allocates next -- here our import, in a
  training script the model's construction. It costs ~0.1 s however small the code that
  triggers it, so it is torch's cost, not the importer's: collecting in both arms takes it out
  of the comparison without hiding anything speedtronic itself allocates.

The modules' bytecode is cached (in a temporary ``PYTHONPYCACHEPREFIX``, filled by a warm-up
interpreter), as it is for an installed package: pip compiles at install time, and a source
checkout writes ``__pycache__`` on its first import. An environment with
``PYTHONDONTWRITEBYTECODE=1`` (this project's VMs) compiles every speedtronic module on every
import instead -- two to three times the figure; ``--compile`` measures that case.

Rounds are rotated: each round starts one interpreter per arm (baseline and variant, raw and
debt-paid) beginning at a different one, so a slow patch of the machine falls on every arm
alike. The report gives best-of-N beside the median, the machine's load before and after,
and, from a few more interpreters (debt paid, median per module), which speedtronic modules
(and other packages new after torch) the import loads and their summed CPU self time.

    python benchmarks/import_cost.py --rounds 15
    python benchmarks/import_cost.py --rounds 9 --baseline main   # and main's import beside

``--baseline REV`` measures the import of an earlier commit too (unpacked with ``git archive``)
in the same rotated rounds, ``speedtronic.Trainer`` only: a before/after under one load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = "import speedtronic; speedtronic.Trainer"
VARIANTS = {
    "speedtronic.Trainer": TARGET,
    "speedtronic.engine Trainer": "from speedtronic.engine.trainer import Trainer",
}
# Modules that belong to reading a config, not to training; none should load here.
CONFIG_MACHINERY = ("jsonschema", "yaml", "speedtronic.config")
PAY_DEBT = "import gc; gc.collect()\n"
IN_PROCESS = "import time as _t\n_s = _t.process_time()\n{code}\nprint(_t.process_time() - _s)\n"


def script(code: str | None, pay_debt: bool, in_process: bool = False) -> str:
    """The child's program: torch, maybe a full collection, then ``code`` (none: baseline)."""
    text = "import torch\n" + (PAY_DEBT if pay_debt else "")
    if code is not None:
        text += IN_PROCESS.format(code=code) if in_process else code + "\n"
    return text


def child_env(bytecode_cache: str | None) -> dict[str, str]:
    """One thread; compiled modules read from (and written to) ``bytecode_cache``, or, where
    that is None, the sources compiled on every import (``PYTHONDONTWRITEBYTECODE``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPYCACHEPREFIX", None)
    if bytecode_cache is None:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    else:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = bytecode_cache
    return env


ENV: dict[str, str] = {}  # the children's environment, set once by ``main``


def run_child(program: str, tree: Path = ROOT) -> tuple[float, str]:
    """CPU seconds of a fresh interpreter running ``program`` (one thread) in ``tree`` (whose
    ``speedtronic`` it imports), and its stdout."""
    process = subprocess.Popen(
        [sys.executable, "-c", program], env=ENV, cwd=tree, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    out = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    process.stdout.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"import_cost: {program!r} failed")
    return usage.ru_utime + usage.ru_stime, out


def loaded_after_torch(code: str, tree: Path = ROOT) -> list[str]:
    probe = (
        "import sys, json, torch\nbefore = set(sys.modules)\n"
        f"{code}\nprint(json.dumps(sorted(set(sys.modules) - before)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=ENV, cwd=tree
    )
    names: list[str] = json.loads(done.stdout)
    return names


# Per-module CPU self time, read inside the child: ``-X importtime`` reads wall time, which a
# loaded machine inflates several times over. A finder in front of the others wraps each
# module's ``exec_module`` with ``time.process_time()``; self time is a module's inclusive
# time less that of the modules its execution imported.
SELF_TIMES = """
import json, sys, time
stack, self_ms = [], {}
class Timed:
    def find_spec(self, name, path, target=None):
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or isinstance(loader, type) or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module
        def exec_module(module, name=name, run=run):
            stack.append(0.0)
            start = time.process_time()
            try:
                run(module)
            finally:
                total = time.process_time() - start
                children = stack.pop()
                self_ms[name] = (total - children) * 1000
                if stack:
                    stack[-1] += total
        loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, Timed())
"""


def self_times(code: str, runs: int) -> dict[str, float]:
    """Median CPU self time (ms) of each module ``code`` loads after torch, debt paid first."""
    samples: dict[str, list[float]] = defaultdict(list)
    program = script(None, pay_debt=True) + SELF_TIMES + code + "\nprint(json.dumps(self_ms))\n"
    for _ in range(runs):
        _, out = run_child(program)
        for name, ms in json.loads(out).items():
            samples[name].append(ms)
    return {name: statistics.median(values) for name, values in samples.items()}


def summary(values: list[float]) -> str:
    return f"{min(values):+.3f} / {statistics.median(values):+.3f}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--profile-runs", type=int, default=5)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="no bytecode cache: every import compiles the sources (PYTHONDONTWRITEBYTECODE)",
    )
    parser.add_argument("--baseline", metavar="REV", help="an earlier commit to measure beside")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="import-cost-") as scratch:
        ENV.update(child_env(None if args.compile else str(Path(scratch) / "pyc")))
        trees = {"": ROOT}
        if args.baseline:
            trees = {args.baseline: Path(scratch) / "baseline", **trees}
            trees[args.baseline].mkdir()
            archive = subprocess.run(
                ["git", "archive", args.baseline], cwd=ROOT, capture_output=True, check=True
            )
            subprocess.run(
                ["tar", "-x"], input=archive.stdout, cwd=trees[args.baseline], check=True
            )
        for tree in trees.values():  # fills the cache: the rounds read compiled modules
            for code in VARIANTS.values():
                run_child(script(code, pay_debt=False), tree)
        report(args.rounds, args.profile_runs, args.compile, trees)


def report(rounds: int, profile_runs: int, compile_sources: bool, trees: dict[str, Path]) -> None:
    load_before = os.getloadavg()
    print(
        f"import cost over `import torch` (CPU s, {rounds} rounds, best of N / median, "
        f"{'sources compiled' if compile_sources else 'bytecode cached'}; "
        f"load {load_before[0]:.1f} {load_before[1]:.1f} before)"
    )
    print("| import | GC debt | paired over baseline | in-process | config machinery loaded |")
    print("|---|---|---|---|---|")
    variants = VARIANTS if len(trees) == 1 else {"speedtronic.Trainer": TARGET}
    for name, code in variants.items():
        # An arm: (tree, GC debt paid, variant or the bare ``import torch`` baseline ("")).
        arms = [(tree, pay, role) for tree in trees for pay in (False, True) for role in ("", name)]
        arms = [(tree, pay, role) for tree, pay, role in arms if role or tree == next(iter(trees))]
        whole: dict[tuple[str, bool, str], list[float]] = defaultdict(list)
        inside: dict[tuple[str, bool], list[float]] = defaultdict(list)
        for round_index in range(rounds):
            start = round_index % len(arms)
            for tree, pay, role in arms[start:] + arms[:start]:
                program = script(code if role else None, pay, in_process=True)
                cpu, out = run_child(program, trees[tree])
                whole[tree if role else "", pay, role].append(cpu)
                if role:
                    inside[tree, pay].append(float(out.split()[-1]))
        for tree, path in trees.items():
            loaded = loaded_after_torch(code, path)
            machinery = ", ".join(m for m in CONFIG_MACHINERY if m in loaded) or "none"
            for pay in (False, True):
                variant, baseline = whole[tree, pay, name], whole["", pay, ""]
                paired = [v - b for v, b in zip(variant, baseline, strict=True)]
                print(
                    f"| `{name}`{f' at {tree}' if tree else ''} | {'paid' if pay else 'raw'} | "
                    f"{min(variant) - min(baseline):+.3f} / {statistics.median(paired):+.3f} | "
                    f"{summary(inside[tree, pay])} | {machinery} |"
                )
    load_after = os.getloadavg()
    print(f"(load {load_after[0]:.1f} {load_after[1]:.1f} after)")

    loaded = loaded_after_torch(TARGET)
    times = self_times(TARGET, profile_runs)
    ours = [m for m in loaded if m == "speedtronic" or m.startswith("speedtronic.")]
    others = [m for m in loaded if m not in ours and not m.startswith("_")]
    by_package: dict[str, float] = defaultdict(float)
    for module in ours:
        by_package[".".join(module.split(".")[:2])] += times.get(module, 0.0)
    print(
        f"\n`{TARGET}` loads {len(ours)} speedtronic modules, CPU self time "
        f"{sum(by_package.values()):.1f} ms (median of {profile_runs}, "
        "debt paid):"
    )
    for package, ms in sorted(by_package.items(), key=lambda item: -item[1]):
        count = sum(1 for m in ours if ".".join(m.split(".")[:2]) == package)
        print(f"  {package:<28} {ms:6.1f} ms  ({count} modules)")
    other_packages: dict[str, float] = defaultdict(float)
    for module in others:
        other_packages[module.split(".")[0]] += times.get(module, 0.0)
    listed = ", ".join(
        f"{p} {ms:.1f} ms" for p, ms in sorted(other_packages.items(), key=lambda i: -i[1])
    )
    print(f"  other packages new after torch: {listed or 'none'}")
    print("  modules: " + " ".join(ours))


if __name__ == "__main__":
    main()
