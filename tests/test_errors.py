"""Errors are built from findings and carry their numbers; the module stands alone."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import safeview
from safeview import ArgumentError, BoundsError, ConfigError, OverlapError, SafeViewError
from safeview.findings import Finding


def test_the_errors_module_depends_on_nothing_of_the_package() -> None:
    path = Path(safeview.__file__).parent / "errors.py"
    spec = importlib.util.spec_from_file_location("standalone_errors", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # no safeview import may run for this to work
    assert module.BoundsError.__mro__[1].__name__ == "SafeViewError"


def test_bounds_error_carries_the_finding_and_its_numbers() -> None:
    finding = Finding.out_of_bounds(
        "model.layers.78.self_attn",
        storage=None,
        byte_offset=3_061_248,
        extent_bytes=130_346_866_176,
        storage_nbytes=130_343_768_064,
    )
    error = BoundsError(finding, storage_nbytes=130_343_768_064, device="meta", policy="strict")
    assert error.finding is finding
    assert (error.kind, error.check, error.name) == (
        "out_of_bounds",
        "storage",
        "model.layers.78.self_attn",
    )
    assert error.overflow_bytes == 3_098_112
    assert error.limit_bytes == 130_343_768_064
    assert str(error) == (
        "view 'model.layers.78.self_attn' needs bytes [3,061,248, 130,346,866,176) but the "
        "storage has 130,343,768,064 bytes (3,098,112 bytes past the end) [device meta, policy "
        "strict]"
    )


def test_bounds_error_of_a_sanitized_op_names_the_op_and_the_call_site() -> None:
    finding = Finding.out_of_bounds(None, storage=None, byte_offset=0, extent_bytes=9,
                                    storage_nbytes=8)  # fmt: skip
    error = BoundsError(
        finding,
        storage_nbytes=8,
        device="cpu",
        policy="strict",
        op="aten::set_",
        site="offloading/worker.py:113 in register_kv_caches",
    )
    assert "(by aten::set_ at offloading/worker.py:113 in register_kv_caches)" in str(error)


def test_overlap_error_lists_ten_findings_and_counts_the_rest() -> None:
    findings = [Finding.overlap(f"a{i}", f"b{i}", storage="kv", byte=i, group=0) for i in range(12)]
    error = OverlapError(findings, policy="strict")
    text = str(error)
    assert text.startswith("12 overlap(s) between views that must not share bytes [policy strict]")
    assert "views 'a9' and 'b9' (group 0) both use byte 9" in text
    assert "'a10'" not in text
    assert "... and 2 more" in text
    assert error.findings == error.overlaps == tuple(findings)


def test_config_and_argument_errors_are_also_the_builtin_kinds_callers_catch() -> None:
    config = ConfigError("SAFEVIEW_BOUNDS_POLICY", "lax", ["strict", "warn", "off"])
    assert isinstance(config, ValueError)
    assert isinstance(config, SafeViewError)
    assert str(config) == (
        "SAFEVIEW_BOUNDS_POLICY='lax' is not a valid value; allowed values: strict, warn, off"
    )
    argument = ArgumentError("num_blocks must be a non-negative integer; got True (bool)")
    assert isinstance(argument, TypeError)
    assert isinstance(argument, ValueError)
