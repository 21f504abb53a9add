"""torch is optional: the command and the arithmetic work without it, and every name that needs
it says what to install. Runs in a subprocess where importing torch fails."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PLANS = Path(__file__).parent.parent / "examples" / "plans"

# A meta-path finder that refuses torch, as an environment without it would.
_NO_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NoTorch())
"""


def _without_torch(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFEVIEW_")}
    return subprocess.run(
        [sys.executable, "-c", _NO_TORCH + textwrap.dedent(code), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_plan_checker_and_the_arithmetic_need_no_torch() -> None:
    result = _without_torch(
        """
        import safeview
        from safeview import BlockLayout, Plan, find_overlaps, packed_layouts
        plan = Plan.load(sys.argv[1])
        print(plan.check().ok, find_overlaps(packed_layouts({"a": 8, "b": 8}, num_blocks=4)))
        print(BlockLayout(num_blocks=2, page_bytes=8, block_stride_bytes=8).extent_bytes)
        """,
        str(PLANS / "glm_5_2_fp8_packed.json"),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "[]", "16"]


@pytest.mark.parametrize(
    "code",
    [
        "safeview.make_view",
        "safeview.kv",
        "safeview.vllm",
        "safeview.sanitize().__enter__()",
    ],
)
def test_names_that_need_torch_say_what_to_install(code: str) -> None:
    result = _without_torch(f"import safeview\n{code}\n")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: safeview's views, registrations and sanitizer need torch")
    # safeview is on no package index: the hint names what works from a checkout or a path
    assert "pip install -e '.[torch]'" in last
    assert "pip install '/path/to/safeview[torch]'" in last
    assert "pip install 'safeview[" not in last


@pytest.mark.slow
def test_a_caught_error_prints_nothing() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFEVIEW_")}
    code = """
    import torch, safeview
    meta = torch.empty(64, dtype=torch.int8, device="meta")
    layout = safeview.BlockLayout(num_blocks=5, page_bytes=16, block_stride_bytes=16)
    try:
        safeview.make_view(meta, layout)
    except safeview.BoundsError:
        pass
    safeview.make_view(meta, layout, policy="warn")   # a warning, to no handler of the app's
    """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    # the caught error prints nothing (its event comes with the exception); the warning, which
    # no handler of the app's shows, is one line on standard error (tests/test_log.py)
    [line] = result.stderr.splitlines()
    assert line.startswith('safeview WARNING: event="bounds_violation" ')
    assert 'policy="warn"' in line
    assert result.stdout == ""
