"""What ``SAFEVIEW_GUARD`` costs every Python process a guarded server starts, with a verdict.

Every process whose environment sets ``SAFEVIEW_GUARD`` runs the start-up hook
(``safeview-guard.pth`` loads ``safeview/guard/_startup.py``), torch or not. This measures it as
users pay it: a real ``python -c pass`` subprocess with ``SAFEVIEW_GUARD=strict`` against one with
the variable unset, interleaved (odd rounds in reverse order, so that both halves see the same
load), and compares the medians. Target: at most +3 ms.

It also names the modules the hook imports that ``python -c pass`` does not (target: none but
``safeview.guard._startup`` itself), and whether ``_startup.py``'s bytecode is cached: an installed
wheel has it; with ``PYTHONDONTWRITEBYTECODE`` set and no cache, every start compiles the file again
(about 1 ms more).

Run: python benchmarks/bench_startup.py [--rounds 40] [--python PATH]
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

TARGET_MS = 3.0
MODULES = "import sys; print(sorted(sys.modules))"
# whether the interpreter measured has _startup.py's bytecode cached (finding the package's folder
# imports nothing of it)
CACHED = (
    "import importlib.util as u, os; s = u.find_spec('safeview'); "
    "print(os.path.exists(u.cache_from_source("
    "os.path.join(list(s.submodule_search_locations)[0], 'guard', '_startup.py'))))"
)


def _environment(guard: str | None) -> dict[str, str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SAFEVIEW_")}
    if guard is not None:
        environment["SAFEVIEW_GUARD"] = guard
    return environment


def _seconds(python: str, environment: dict[str, str]) -> float:
    began = time.perf_counter()
    subprocess.run([python, "-c", "pass"], env=environment, check=True)
    return time.perf_counter() - began


def _modules(python: str, guard: str | None) -> set[str]:
    out = subprocess.run(
        [python, "-c", MODULES], env=_environment(guard), capture_output=True, text=True,
        cwd="/", check=True,
    ).stdout  # fmt: skip
    return set(ast.literal_eval(out))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40, help="runs of each (at least 20)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter to start")
    args = parser.parse_args()
    rounds = max(20, args.rounds)
    purelib = subprocess.run(
        [args.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    if not Path(purelib, "safeview-guard.pth").exists():
        print(f"safeview-guard.pth is not in {purelib}: reinstall safeview (pip install -e .)")
        return 2
    extra = _modules(args.python, "strict") - _modules(args.python, None)
    cached = subprocess.run(
        [args.python, "-c", CACHED], env=_environment(None), capture_output=True, text=True,
        cwd="/", check=True,
    ).stdout.strip() == "True"  # fmt: skip

    unset, guarded = _environment(None), _environment("strict")
    _seconds(args.python, unset)  # warm the file cache for both
    _seconds(args.python, guarded)
    plain: list[float] = []
    hooked: list[float] = []
    for index in range(rounds):
        pairs = ((plain, unset), (hooked, guarded))
        for times, environment in pairs if index % 2 == 0 else pairs[::-1]:
            times.append(_seconds(args.python, environment))
    plain_ms = statistics.median(plain) * 1e3
    hooked_ms = statistics.median(hooked) * 1e3
    cost_ms = hooked_ms - plain_ms
    print(f"python: {args.python} ({sysconfig.get_python_version()}), {rounds} runs of each")
    print(f"_startup.py bytecode cached: {'yes' if cached else 'no (compiled at every start)'}")
    print(f"modules the hook adds: {sorted(extra)}")
    print(f"python -c pass, SAFEVIEW_GUARD unset:  median {plain_ms:6.2f} ms")
    print(f"python -c pass, SAFEVIEW_GUARD=strict: median {hooked_ms:6.2f} ms")
    within = cost_ms <= TARGET_MS and extra <= {"safeview.guard._startup"}
    verdict = "PASS" if within else "FAIL"
    print(f"start-up cost: {cost_ms:+.2f} ms (target <= +{TARGET_MS:.0f} ms, no module "
          f"beyond the hook's own): {verdict}")  # fmt: skip
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
