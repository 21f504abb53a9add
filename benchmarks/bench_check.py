"""Wall time of ``safeview check`` on 100,000-view plans, as a user runs the command.

The plans (``benchmarks/big_plans.py``, written to a temporary folder first): 100,000 views of one
packed storage; 99,000 one-byte-page views of three dividing block strides interleaved over the
same bytes in two KV-cache groups, plus 1,000 contiguous views without a group (clean); the same
with violations. Each command runs as its own process, the console script ``safeview`` (the
entry point a user types) and ``python -m safeview``, ``--rounds`` times, interleaved; the figure
is the median wall time, with the fastest and slowest run. Then, in this process, where the time
of one check goes (reading and validating the plan, the checker's records, ``check_views``).

Targets: ``check`` within 3 s on each clean plan, ``--map`` within 30 s on the mixed one.

Run: python benchmarks/bench_check.py [--rounds 5] [--map]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import big_plans

from safeview.plan import Plan


def wall(command: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, check=False)
    return time.perf_counter() - start, done.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--map", action="store_true", help="also time --map on the mixed plan")
    args = parser.parse_args()
    script = Path(sys.executable).with_name("safeview")
    with tempfile.TemporaryDirectory() as folder:
        paths = big_plans.write(Path(folder))
        runs: dict[str, list[str]] = {}
        for name, path in paths.items():
            runs[f"safeview check {name}"] = [str(script), "check", str(path)]
            runs[f"python -m safeview check {name}"] = [sys.executable, "-m", "safeview", "check",
                                                        str(path)]  # fmt: skip
        targets = {
            "safeview check packed_100k": 3.0,
            "safeview check mixed_100k": 3.0,
        }
        if args.map:
            image = Path(folder) / "map.png"
            runs["safeview check mixed_100k --map"] = [
                str(script), "check", str(paths["mixed_100k"]), "--map", str(image),
            ]  # fmt: skip
            targets["safeview check mixed_100k --map"] = 30.0
        times: dict[str, list[float]] = {name: [] for name in runs}
        codes: dict[str, int] = {}
        for round_index in range(args.rounds):
            order = list(runs.items())
            if round_index % 2:
                order.reverse()
            for name, command in order:
                seconds, codes[name] = wall(command)
                times[name].append(seconds)
        print(f"wall time of the command, {args.rounds} runs each (median, fastest-slowest)")
        for name, values in times.items():
            print(
                f"  {name:42s} {statistics.median(values):6.2f} s "
                f"({min(values):.2f}-{max(values):.2f})  exit {codes[name]}"
            )

        print("in this process, one check of mixed_100k (median of 3):")
        phases: dict[str, list[float]] = {"read + validate": [], "records": [], "check_views": []}
        for _ in range(3):
            start = time.perf_counter()
            plan = Plan.load(paths["mixed_100k"])
            loaded = time.perf_counter()
            sizes, records = plan.sizes(), plan.records()
            recorded = time.perf_counter()
            from safeview.check import check_views

            check_views(sizes, records)
            checked = time.perf_counter()
            phases["read + validate"].append(loaded - start)
            phases["records"].append(recorded - loaded)
            phases["check_views"].append(checked - recorded)
        for phase, values in phases.items():
            print(f"  {phase:16s} {statistics.median(values):6.2f} s")

    print()
    missed = False
    for name, target in targets.items():
        figure = statistics.median(times[name])
        verdict = "met" if figure <= target else f"MISSED by {figure - target:.2f} s"
        missed |= figure > target
        print(f"{name:42s} {figure:6.2f} s  target <= {target:g} s  {verdict}")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
