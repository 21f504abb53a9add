"""The examples run, and what they say about a reallocated KV cache is what torch does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_a_reallocated_storage_takes_its_tensors_along_and_leaves_old_addresses_freed() -> None:
    # what the examples say, checked on the installed torch: the four-argument set_ moves the
    # storage; every tensor over it follows (they share it), an address taken before does not
    kv = torch.zeros(64, dtype=torch.int8)
    layer = torch.as_strided(kv, (4, 16), (16, 1), 0)
    address = kv.untyped_storage().data_ptr()
    grown = torch.empty(0, dtype=torch.int8).set_(kv.untyped_storage(), 0, (5, 16), (16, 1))
    assert kv.untyped_storage().nbytes() == 80
    assert layer.data_ptr() == kv.data_ptr() == grown.data_ptr() != address
    grown.fill_(7)
    assert int(layer.sum()) == 7 * 64  # one cache still, not two that drift apart


@pytest.mark.parametrize(
    ("script", "said"),
    [
        ("packed_kv_cache.py", "the views made before followed the copy, and an address taken "
         "before"),
        ("sanitized_worker.py", "the layers' tensors followed the copy (True), but an address "
         "taken before"),
    ],
)  # fmt: skip
def test_the_examples_say_what_a_reallocation_does(script: str, said: str) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    output = " ".join(result.stdout.split())
    assert said in output
    assert "points at freed memory" in output
    assert "every view made before now points at freed memory" not in output
    assert "tensor points at freed memory" not in output


@pytest.mark.slow
def test_the_sanitize_benchmark_runs_and_costs_md_gives_its_per_op_cost() -> None:
    costs = (EXAMPLES.parent / "docs" / "costs.md").read_text()
    assert "python benchmarks/bench_sanitize.py" in costs
    assert "never the model's forward\npass or a decode loop" in costs
    assert "| added per op (runs 1, 2) |" in costs
    result = subprocess.run(
        [sys.executable, str(EXAMPLES.parent / "benchmarks" / "bench_sanitize.py"),
         "--rounds", "3", "--steps", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    [decode] = [line for line in result.stdout.splitlines() if line.startswith("decode step")]
    assert "96 ops/step" in decode
    assert "us per op" in decode
