"""Where the policy comes from: argument, scope, environment, default; across threads and tasks."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Generator

import pytest
import torch

from safeview import BlockLayout, ConfigError, Policy, current_policy, make_view, policy_scope
from safeview.policy import ENV_POLICY

PAST_END = BlockLayout(num_blocks=5, page_bytes=16, block_stride_bytes=16)


def test_default_is_strict() -> None:
    assert current_policy() is Policy.STRICT


def test_argument_beats_scope() -> None:
    with policy_scope("off"):
        assert current_policy("warn") is Policy.WARN
        assert current_policy() is Policy.OFF


def test_nested_scopes_restore_the_outer_one() -> None:
    with policy_scope(Policy.WARN) as outer:
        assert outer is Policy.WARN
        with policy_scope("off"):
            assert current_policy() is Policy.OFF
            with policy_scope(" STRICT "):
                assert current_policy() is Policy.STRICT
            assert current_policy() is Policy.OFF
        assert current_policy() is Policy.WARN
    assert current_policy() is Policy.STRICT


def test_scope_is_restored_when_the_block_raises() -> None:
    with pytest.raises(KeyError), policy_scope("off"):
        raise KeyError("boom")
    assert current_policy() is Policy.STRICT


def test_scope_refuses_an_unknown_policy_naming_the_allowed_ones() -> None:
    with pytest.raises(ConfigError) as caught, policy_scope("lax"):
        pass
    assert caught.value.value == "lax"
    assert caught.value.allowed == ("strict", "warn", "off")
    assert "allowed values: strict, warn, off" in str(caught.value)


def test_scope_changes_what_make_view_does() -> None:
    meta = torch.empty(64, dtype=torch.int8, device="meta")
    with policy_scope("warn"):
        assert make_view(meta, PAST_END).shape == (5, 16)


def test_eight_threads_with_different_scopes_do_not_leak() -> None:
    policies = [Policy.STRICT, Policy.WARN, Policy.OFF, Policy.WARN] * 2
    barrier = threading.Barrier(len(policies))
    seen: dict[int, set[Policy]] = {i: set() for i in range(len(policies))}
    results: dict[int, str] = {}
    meta = torch.empty(64, dtype=torch.int8, device="meta")

    def worker(index: int, policy: Policy) -> None:
        with policy_scope(policy):
            barrier.wait()
            for _ in range(200):
                seen[index].add(current_policy())
            try:
                make_view(meta, PAST_END)
                results[index] = "view"
            except Exception as error:
                results[index] = type(error).__name__
            barrier.wait()
        seen[index].add(current_policy())

    threads = [threading.Thread(target=worker, args=(i, p)) for i, p in enumerate(policies)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, policy in enumerate(policies):
        assert seen[index] == {policy, Policy.STRICT}
        assert results[index] == ("BoundsError" if policy is Policy.STRICT else "view")
    assert current_policy() is Policy.STRICT


def test_many_asyncio_tasks_with_different_scopes_do_not_leak() -> None:
    async def task(policy: Policy) -> set[Policy]:
        seen = set()
        with policy_scope(policy):
            for _ in range(20):
                await asyncio.sleep(0)
                seen.add(current_policy())
        return seen

    async def main() -> list[set[Policy]]:
        policies = [list(Policy)[i % 3] for i in range(300)]
        results = await asyncio.gather(*(task(p) for p in policies))
        assert all(seen == {p} for seen, p in zip(results, policies))
        return results

    assert len(asyncio.run(main())) == 300
    assert current_policy() is Policy.STRICT


_PROBE = """
import torch, safeview
meta = torch.empty(64, dtype=torch.int8, device="meta")
print(safeview.current_policy().value)
layout = safeview.BlockLayout(num_blocks=5, page_bytes=16, block_stride_bytes=16)
try:
    safeview.make_view(meta, layout)
    print("view")
except safeview.BoundsError:
    print("refused")
"""


def _run_probe(value: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFEVIEW_")}
    if value is not None:
        env[ENV_POLICY] = value
    return subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, "strict refused"),
        ("warn", "warn view"),
        pytest.param("  Off\n", "off view", marks=pytest.mark.slow),
        pytest.param("STRICT", "strict refused", marks=pytest.mark.slow),
        # set to nothing is unset, as SAFEVIEW_LOG_FORMAT= is
        pytest.param("", "strict refused", marks=pytest.mark.slow),
        pytest.param("  ", "strict refused", marks=pytest.mark.slow),
    ],
)
def test_environment_variable_sets_the_default(value: str | None, expected: str) -> None:
    result = _run_probe(value)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == expected.split()


@pytest.mark.slow
def test_invalid_environment_variable_is_a_config_error_naming_it() -> None:
    result = _run_probe("lenient")
    assert result.returncode == 1
    assert (
        "safeview.errors.ConfigError: SAFEVIEW_BOUNDS_POLICY='lenient' is not a valid value; "
        "allowed values: strict, warn, off" in result.stderr
    )


def test_scopes_closed_out_of_order_leave_the_default_in_force() -> None:
    outer = policy_scope("warn")
    inner = policy_scope("off")
    outer.__enter__()
    inner.__enter__()
    assert current_policy() is Policy.OFF
    outer.__exit__(None, None, None)  # the outer one first, as a late-closed generator does
    assert current_policy() is Policy.OFF
    inner.__exit__(None, None, None)
    assert current_policy() is Policy.STRICT


def test_a_scope_closed_from_another_thread_does_not_raise() -> None:
    scope = policy_scope("warn")
    scope.__enter__()
    errors: list[BaseException] = []

    def close() -> None:
        try:
            scope.__exit__(None, None, None)
        except BaseException as error:  # pragma: no cover - the failure being tested for
            errors.append(error)

    thread = threading.Thread(target=close)
    thread.start()
    thread.join()
    assert errors == []
    assert current_policy() is Policy.STRICT  # closed, here too


def test_a_scope_inside_a_suspended_generator_is_seen_by_its_caller() -> None:
    def views() -> Generator[Policy, None, None]:
        with policy_scope("off"):
            yield current_policy()

    generator = views()
    assert next(generator) is Policy.OFF
    assert current_policy() is Policy.OFF  # the generator is suspended inside its scope
    generator.close()
    assert current_policy() is Policy.STRICT


def _warn_cell(row_start: str) -> str:
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs" / "policies.md").read_text()
    [row] = [line for line in text.splitlines() if line.startswith(f"| {row_start}")]
    return row.strip("|").split("|")[2]


def test_warn_where_torch_refuses_is_what_the_block_views_row_says() -> None:
    from safeview import BoundsError
    from safeview.kv import block_views

    cell = _warn_cell("`block_views`")
    assert "cannot be (torch refuses it, safeview does not grow the storage)" in cell
    assert "`BoundsError` naming every such view, chained to torch's error; on meta it is made" in (
        cell
    )
    raw = torch.zeros(2 * 4 * 16, dtype=torch.int8)
    caches = {f"l{i}": torch.as_strided(raw, (4, 16), (32, 1), i * 16) for i in range(2)}
    with pytest.raises(BoundsError) as caught:
        block_views(caches, dict.fromkeys(caches, 16), num_blocks=5, packed=caches, policy="warn")
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert [f.views[0] for f in caught.value.findings] == ["l0", "l1"]
    assert raw.untyped_storage().nbytes() == 128  # never grown
    meta_raw = torch.empty(128, dtype=torch.int8, device="meta")
    on_meta = {f"l{i}": torch.as_strided(meta_raw, (4, 16), (32, 1), i * 16) for i in range(2)}
    made = block_views(on_meta, dict.fromkeys(on_meta, 16), num_blocks=5, packed=on_meta,
                       policy="warn")  # fmt: skip
    assert [view.shape for (view,) in made.tensors_per_block.values()] == [(5, 16)] * 2


def test_warn_under_sanitize_lets_the_op_run_as_the_row_says() -> None:
    import safeview

    assert "a four-argument `set_` past the end of a storage reallocates it" in _warn_cell(
        "`sanitize()`"
    )
    kv = torch.zeros(64, dtype=torch.int8)
    with safeview.sanitize(policy="warn"):
        torch.empty(0, dtype=torch.int8).set_(kv.untyped_storage(), 0, (5, 16), (16, 1))
    assert kv.untyped_storage().nbytes() == 80  # what torch does without safeview
