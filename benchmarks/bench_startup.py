"""What ``SAFEVIEW_GUARD`` costs a Python process at start-up, as users pay it, with verdicts.

Every process whose environment sets ``SAFEVIEW_GUARD`` runs the start-up hook
(``safeview-guard.pth`` loads ``safeview/guard/_startup.py``), torch or not; a process that imports
torch then has the guard go on at that import. Four figures, each a real subprocess with
``SAFEVIEW_GUARD=strict`` against one with the variable unset, interleaved (odd rounds in reverse
order, so that both halves see the same load), as the median over rounds of the pair's difference
(``python -c pass``) or ratio (``import torch``):

1. ``python -c pass``, bytecode cached (a wheel install, or any install once it has run).
   Target: at most +3 ms.
2. ``python -c pass`` with ``PYTHONDONTWRITEBYTECODE=1`` and a cold cache (common in containers):
   the hook's file is compiled at every start. Target: at most +3 ms.
3. ``python -c "import torch"``, bytecode cached: the guard going on at that import (safeview's
   modules imported, torch's entry points replaced, two kernels registered). Target: at most
   +5% of ``import torch``.
4. ``python -c "import torch"``, torch's bytecode cached but safeview's not (an editable install
   under ``PYTHONDONTWRITEBYTECODE=1``): safeview's modules compiled at every start. Target: the
   same +5%.

Each figure is given in CPU time (user + system, of the child alone: ``os.wait4``), which a busy
machine disturbs less, and in wall time beside it; the verdicts read CPU time. A whole
``import torch`` varies by more than the guard adds on a busy machine, so figures 3 and 4 also
time the guard's own part inside one process (``import torch`` unguarded, then the hook's
``install``, each in CPU time): 1 + its share of the import; either figure within the target
passes. The caches are two
folders of this run (``PYTHONPYCACHEPREFIX``), so nothing is written beside the sources: one warmed
by an unguarded ``import torch`` (torch's and the standard library's bytecode, none of
safeview's), the other a copy of it warmed once more under the guard (safeview's too).

It also names the modules the hook imports that ``python -c pass`` does not (target: none but
``safeview.guard._startup``). ``--profile`` prints, instead, where the guard's time at
``import torch`` goes: the modules it adds (``python -X importtime``) and a ``cProfile`` of the
guard going on, in a fresh subprocess.

Run: python benchmarks/bench_startup.py [--rounds 40] [--torch-rounds 8] [--python PATH]
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

PASS_TARGET_MS = 3.0
TORCH_TARGET = 1.05
MODULES = "import sys; print(sorted(sys.modules))"
IMPORT_TORCH = "import torch"
# the guard's own part of a guarded import torch, timed inside one unguarded process: what the
# hook does once torch has run (its file loaded, safeview's modules imported, the doors put on),
# against the import itself, in CPU time
GUARD_PART = """
import time
began = time.process_time()
import torch
torch_s = time.process_time() - began
began = time.process_time()
from safeview.guard import _startup
_startup.install("strict")
guard_s = time.process_time() - began
from safeview.guard import process
assert process.active()
print(torch_s, guard_s)
"""
# the guard going on in a process that has imported torch: the hook's own install, profiled
PROFILE = """
import cProfile, os, pstats, sys
import torch
from safeview.guard import _startup
profile = cProfile.Profile()
profile.enable()
_startup.install("strict")
profile.disable()
pstats.Stats(profile).sort_stats("cumulative").print_stats(25)
"""


def _environment(guard: str | None, **variables: str) -> dict[str, str]:
    """This environment without safeview's variables; given bytecode settings replace this
    environment's (a cache folder of this run, and whether to write into it)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SAFEVIEW_")}
    if variables:
        for name in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX"):
            environment.pop(name, None)
    environment.update(variables)
    if guard is not None:
        environment["SAFEVIEW_GUARD"] = guard
    return environment


def _run(python: str, code: str, environment: dict[str, str]) -> tuple[float, float]:
    """CPU seconds (user + system) and wall seconds of one ``python -c code``."""
    began = time.perf_counter()
    child = subprocess.Popen([python, "-c", code], env=environment, cwd="/")
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - began
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"{python} -c {code!r} failed with status {child.returncode}")
    return usage.ru_utime + usage.ru_stime, wall


def _pairs(
    python: str, code: str, rounds: int, unset: dict[str, str], guarded: dict[str, str]
) -> dict[str, list[float]]:
    """``rounds`` interleaved runs of each: CPU and wall seconds, unset and guarded."""
    _run(python, code, unset)  # warm the file cache for both
    _run(python, code, guarded)
    found: dict[str, list[float]] = {key: [] for key in ("cpu0", "cpu1", "wall0", "wall1")}
    for index in range(rounds):
        order = ((0, unset), (1, guarded))
        for which, environment in order if index % 2 == 0 else order[::-1]:
            cpu, wall = _run(python, code, environment)
            found[f"cpu{which}"].append(cpu)
            found[f"wall{which}"].append(wall)
    return found


def _difference_ms(found: dict[str, list[float]], kind: str) -> float:
    return statistics.median(
        (b - a) * 1e3 for a, b in zip(found[f"{kind}0"], found[f"{kind}1"], strict=True)
    )


def _ratio(found: dict[str, list[float]], kind: str) -> float:
    return statistics.median(
        b / a for a, b in zip(found[f"{kind}0"], found[f"{kind}1"], strict=True)
    )


def _guard_part(python: str, environment: dict[str, str]) -> tuple[float, float]:
    """CPU seconds of ``import torch`` and of the guard going on after it, in one process."""
    out = subprocess.run(
        [python, "-c", GUARD_PART], env=environment, capture_output=True, text=True, cwd="/",
        check=True,
    ).stdout.split()  # fmt: skip
    return float(out[-2]), float(out[-1])


def _modules(python: str, guard: str | None) -> set[str]:
    out = subprocess.run(
        [python, "-c", MODULES], env=_environment(guard), capture_output=True, text=True,
        cwd="/", check=True,
    ).stdout  # fmt: skip
    return set(ast.literal_eval(out))


def _caches(python: str, root: Path) -> tuple[Path, Path]:
    """Two bytecode caches: torch's and the standard library's (``cold``: none of safeview's),
    and a copy with safeview's added (``warm``)."""
    cold, warm = root / "cold", root / "warm"
    subprocess.run(
        [python, "-c", IMPORT_TORCH], env=_environment(None, PYTHONPYCACHEPREFIX=str(cold)),
        cwd="/", check=True,
    )  # fmt: skip
    shutil.copytree(cold, warm)
    subprocess.run(
        [python, "-c", IMPORT_TORCH], env=_environment("strict", PYTHONPYCACHEPREFIX=str(warm)),
        cwd="/", check=True,
    )  # fmt: skip
    if any("safeview" in path.parts for path in cold.rglob("*.pyc")):
        raise SystemExit("an unguarded import torch cached safeview's bytecode: no cold cache")
    return cold, warm


def _profile(python: str) -> int:
    """The modules the guard adds at ``import torch`` (self time, ``-X importtime``), and a
    cProfile of it going on."""

    def importtime(guard: str | None) -> dict[str, int]:
        result = subprocess.run(
            [python, "-X", "importtime", "-c", IMPORT_TORCH], env=_environment(guard),
            capture_output=True, text=True, cwd="/", check=True,
        )  # fmt: skip
        rows = {}
        for line in result.stderr.splitlines():
            parts = line.removeprefix("import time:").split("|")
            if len(parts) == 3 and parts[0].strip().isdigit():
                rows[parts[2].strip()] = int(parts[0])
        return rows

    unset = importtime(None)
    added = {name: micros for name, micros in importtime("strict").items() if name not in unset}
    print(f"modules the guard adds at import torch: {len(added)}, "
          f"{sum(added.values()) / 1e3:.1f} ms of self time (-X importtime)")  # fmt: skip
    for name, micros in sorted(added.items(), key=lambda item: -item[1])[:15]:
        print(f"  {micros / 1e3:7.2f} ms  {name}")
    subprocess.run([python, "-c", PROFILE], env=_environment(None), cwd="/", check=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40, help="python -c pass runs of each")
    parser.add_argument("--torch-rounds", type=int, default=8, help="import torch runs of each")
    parser.add_argument("--python", default=sys.executable, help="the interpreter to start")
    parser.add_argument("--profile", action="store_true", help="where the time goes, instead")
    args = parser.parse_args()
    rounds, torch_rounds = max(10, args.rounds), max(3, args.torch_rounds)
    purelib = subprocess.run(
        [args.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    if not Path(purelib, "safeview-guard.pth").exists():
        print(f"safeview-guard.pth is not in {purelib}: reinstall safeview (pip install -e .)")
        return 2
    if args.profile:
        return _profile(args.python)
    extra = _modules(args.python, "strict") - _modules(args.python, None)

    print(f"python: {args.python} ({sysconfig.get_python_version()}); medians over interleaved "
          f"rounds of the guarded run against the unset one, CPU time (wall time)")  # fmt: skip
    print(f"modules the hook adds to python -c pass: {sorted(extra)}")
    verdicts = [extra <= {"safeview.guard._startup"}]
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as folder:
        cold, warm = _caches(args.python, Path(folder))
        pass_cases = (
            ("bytecode cached", {"PYTHONPYCACHEPREFIX": str(warm)}),
            ("PYTHONDONTWRITEBYTECODE=1, cold cache",
             {"PYTHONPYCACHEPREFIX": str(cold), "PYTHONDONTWRITEBYTECODE": "1"}),
        )  # fmt: skip
        for label, variables in pass_cases:
            variables = dict(variables, PYTHONDONTWRITEBYTECODE="1")  # the caches stay as made
            found = _pairs(
                args.python, "pass", rounds, _environment(None, **variables),
                _environment("strict", **variables),
            )  # fmt: skip
            cost = _difference_ms(found, "cpu")
            verdicts.append(cost <= PASS_TARGET_MS)
            print(f"python -c pass, {label} ({rounds} rounds): unset "
                  f"{statistics.median(found['cpu0']) * 1e3:.1f} ms "
                  f"({statistics.median(found['wall0']) * 1e3:.1f} ms); guarded {cost:+.2f} ms "
                  f"({_difference_ms(found, 'wall'):+.2f} ms); target <= +{PASS_TARGET_MS:.0f} ms: "
                  f"{'PASS' if verdicts[-1] else 'FAIL'}")  # fmt: skip
        torch_cases = (
            ("bytecode cached", warm),
            ("safeview's bytecode not cached (PYTHONDONTWRITEBYTECODE=1)", cold),
        )
        for label, cache in torch_cases:
            variables = {"PYTHONPYCACHEPREFIX": str(cache), "PYTHONDONTWRITEBYTECODE": "1"}
            found = _pairs(
                args.python, IMPORT_TORCH, torch_rounds, _environment(None, **variables),
                _environment("strict", **variables),
            )  # fmt: skip
            ratio = _ratio(found, "cpu")
            print(
                f'python -c "import torch", {label} ({torch_rounds} rounds): unset '
                f"{statistics.median(found['cpu0']) * 1e3:,.0f} ms "
                f"({statistics.median(found['wall0']) * 1e3:,.0f} ms); guarded {ratio:.3f}x, "
                f"{_difference_ms(found, 'cpu'):+.0f} ms ({_ratio(found, 'wall'):.3f}x)"
            )
            parts = [_guard_part(args.python, _environment(None, **variables))
                     for _ in range(torch_rounds)]  # fmt: skip
            torch_ms = statistics.median(torch_s for torch_s, _ in parts) * 1e3
            guard_ms = statistics.median(guard_s for _, guard_s in parts) * 1e3
            share = 1 + guard_ms / torch_ms
            verdicts.append(ratio <= TORCH_TARGET or share <= TORCH_TARGET)
            verdict = "PASS" if verdicts[-1] else "FAIL"
            print(f"  the guard's part, timed in the process: {guard_ms:.1f} ms of CPU after "
                  f"{torch_ms:,.0f} ms of import torch: {share:.3f}x; target <= "
                  f"{TORCH_TARGET:.2f}x (either figure): {verdict}")  # fmt: skip
    print("verdict:", "PASS" if all(verdicts) else "FAIL")
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
