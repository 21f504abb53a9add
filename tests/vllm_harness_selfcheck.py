"""Self-check of tests/vllm_harness.py against the installed vLLM (not a pytest module).

Run with the interpreter that has vLLM::

    .venv-vllm/bin/python tests/vllm_harness_selfcheck.py [--no-plugin] [--devices cpu,meta]

Prints one line per case and device: how many int8 views vLLM's real offloading worker made, how
many transfer regions it registered, and, for the faults, what actually happened (reallocation
with nbytes before/after, the exception and where it was raised, silent overlap, silent alias
merge). Each line ends in ``ok`` or ``UNEXPECTED``; the exit status is 1 if any line is
unexpected. ``--no-plugin`` skips the plugin check, which starts a second interpreter (vLLM's
import alone takes 10 to 15 s on two cores).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import vllm_harness as harness  # noqa: E402


def _short(where: str) -> str:
    return where.split("site-packages/")[-1]


def _views_in_bounds(run: harness.WorkerRun) -> bool:
    """Every view the worker made lies inside the storage as it is after registration."""
    for views in run.views.values():
        for view in views:
            nbytes = view.untyped_storage().nbytes()
            end = view.storage_offset() + sum(
                (n - 1) * s for n, s in zip(view.shape, view.stride())
            )
            if view.numel() and (end + 1) * view.element_size() > nbytes:
                return False
    return True


def _signature(run: harness.WorkerRun) -> dict[str, list[tuple[object, ...]]]:
    """Per layer: (shape, stride, storage_offset, dtype); the pointer differs across devices."""
    return {
        name: [(tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.dtype) for v in views]
        for name, views in run.views.items()
    }


def check_clean(case: str, device: str) -> tuple[bool, str, harness.WorkerRun]:
    built = harness.build(case, device)
    run = harness.run_real_worker(built, record_ops=True, raise_errors=False)
    layers = sum(
        len(built.worker_kv_cache_config.kv_cache_groups[g].layer_names)
        for g in harness.offloaded_group_ids(built.worker_kv_cache_config)
    )
    set_calls = len([op for op in run.ops if op.op == "set_"])
    ok = (
        run.error is None
        and not run.reallocated
        and len(run.views) == layers
        and set_calls == layers
        and _views_in_bounds(run)
        and all(v.dtype == torch.int8 for vs in run.views.values() for v in vs)
    )
    page_strides = sorted(
        {(vs[0].shape[1], vs[0].stride(0)) for vs in run.views.values()}, reverse=True
    )
    shown = ", ".join(f"{p}/{s}" for p, s in page_strides[:3])
    line = (
        f"views={len(run.views)} set_={set_calls} regions={len(run.region_tensors())} "
        f"packed={run.packed} page/stride={shown} storage={built.storage_nbytes:,} B"
    )
    if run.packed and run.packed_tensor is not None:
        line += f" packed_view={tuple(run.packed_tensor.shape)}"
    return ok, line, run


def check_fault(case: str, device: str, fault: str) -> tuple[bool, str]:
    built = harness.build(case, device, **{fault: True})
    run = harness.run_real_worker(built, record_ops=True, raise_errors=False)
    what = f"[{built.fault_note}] "
    if run.error is not None:
        what += f"{type(run.error).__name__}({run.error}) at {_short(run.error_where)}"
    elif run.reallocated:
        moved = run.storage_data_ptr_after != run.storage_data_ptr_before
        grew = [op for op in run.ops if op.storage_nbytes_after != op.storage_nbytes_before]
        what += (
            f"REALLOCATED {run.storage_nbytes_before:,} -> {run.storage_nbytes_after:,} B, "
            f"data_ptr moved={moved}"
        )
        if grew:
            op = grew[0]
            what += f" (by set_ size={op.size} stride={op.stride} offset={op.storage_offset})"
    else:
        what += "no error"
    if run.error is None:
        what += f"; views={len(run.views)} regions={len(run.region_tensors())}"
        if run.packed and run.packed_tensor is not None:
            what += f" taken as PACKED: one region {tuple(run.packed_tensor.shape)} at offset 0"
        overlapping = [
            name for name, vs in run.views.items() if any(v.stride(0) < v.shape[1] for v in vs)
        ]
        if overlapping:
            what += f"; SILENT OVERLAP in {len(overlapping)} layer(s) (stride(0) < page)"
        regions = run.layer_regions()
        merged = [n for n, idx in regions.items() if sum(r == idx for r in regions.values()) > 1]
        if merged and fault == "alias_two_layers":
            what += f"; SILENT ALIAS MERGE {merged[:2]} -> region {regions[merged[0]]}"

    if fault == "worker_page_too_big":
        ok = (
            run.error is None
            and run.reallocated
            and run.storage_nbytes_after > built.storage_nbytes
        )
        if case == "full_attention_lbnhc":
            ok = ok and (run.storage_nbytes_before, run.storage_nbytes_after) == (491_520, 507_904)
    elif fault == "num_blocks_plus_one":
        ok = (
            isinstance(run.error, AssertionError)
            and "group_kernel_blocks" in run.error_where
            and not run.reallocated
        )
    elif fault == "kernel_stride_as_manager":
        ok = (
            run.error is None
            and run.packed
            and run.packed_tensor is not None
            and run.packed_tensor.shape[1] * 2 == next(iter(run.views.values()))[0].shape[1]
        )
    elif fault == "alias_two_layers":
        regions = run.layer_regions()
        names = built.worker_kv_cache_config.kv_cache_groups[0].layer_names
        ok = run.error is None and regions[names[0]] == regions[names[1]]
    else:  # pragma: no cover
        ok = False
    return ok, what


PLUGIN_MODULE = '''
"""Probe plugin: wraps vLLM's KVConnectorFactory.create_connector (a classmethod)."""
CALLS = []


def register():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    original = KVConnectorFactory.create_connector.__func__

    def create_connector(cls, config, role, kv_cache_config):
        connector = original(cls, config, role, kv_cache_config)
        CALLS.append(type(connector).__name__)
        return connector

    KVConnectorFactory.create_connector = classmethod(create_connector)
    CALLS.append("registered")
'''

PLUGIN_DRIVER = """
import os, sys
sys.path.insert(0, {tests!r})
import vllm.plugins
import probe_plugin

os.environ["VLLM_PLUGINS"] = "some_other_plugin"
vllm.plugins.load_general_plugins()
print("filtered_out", probe_plugin.CALLS == [], "flag", vllm.plugins.plugins_loaded)
vllm.plugins.load_general_plugins()
import vllm_harness as harness
harness.reset_general_plugins()
del os.environ["VLLM_PLUGINS"]
vllm.plugins.load_general_plugins()
vllm.plugins.load_general_plugins()
print("loaded_once", probe_plugin.CALLS == ["registered"])
run = harness.run_via_connector(harness.build("full_attention_lbnhc", "cpu"))
print("factory_wrapped", probe_plugin.CALLS, "views", len(run.views),
      "connector", type(run.connector).__name__)
"""


def check_plugin() -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "probe_plugin.py").write_text(PLUGIN_MODULE, encoding="utf-8")
        harness.write_plugin_distribution(tmp, name="safeview_probe", value="probe_plugin:register")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tmp, env.get("PYTHONPATH")) if p)
        env.pop("VLLM_PLUGINS", None)
        proc = subprocess.run(
            [sys.executable, "-c", PLUGIN_DRIVER.format(tests=str(HERE))],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
    lines = [
        ln
        for ln in proc.stdout.splitlines()
        if ln.split(" ")[0] in ("filtered_out", "loaded_once", "factory_wrapped")
    ]
    ok = proc.returncode == 0 and lines == [
        "filtered_out True flag True",
        "loaded_once True",
        "factory_wrapped ['registered', 'HarnessOffloadingConnector'] views 3 "
        "connector HarnessOffloadingConnector",
    ]
    detail = " | ".join(lines) if lines else proc.stderr.strip().splitlines()[-1:]
    return ok, f"rc={proc.returncode} {detail}"


FAULT_CASES: tuple[tuple[str, str], ...] = (
    ("full_attention_lbnhc", "worker_page_too_big"),
    ("full_attention_blhnc", "worker_page_too_big"),
    ("mla_indexer_packed", "worker_page_too_big"),
    ("full_attention_lbnhc", "num_blocks_plus_one"),
    ("mla_indexer_packed", "num_blocks_plus_one"),
    ("kernel_block_8", "kernel_stride_as_manager"),
    ("full_attention_lbnhc", "alias_two_layers"),
    ("attention_mamba", "alias_two_layers"),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-plugin", action="store_true", help="skip the subprocess check")
    parser.add_argument("--devices", default="cpu,meta")
    args = parser.parse_args(argv)
    devices = [d for d in args.devices.split(",") if d]
    start = time.perf_counter()
    print(f"vllm {harness.VLLM_VERSION}, torch {torch.__version__}")
    results: list[bool] = []

    def report(ok: bool, label: str, text: str) -> None:
        results.append(ok)
        print(f"{label:<48} {text}  {'ok' if ok else 'UNEXPECTED'}")

    signatures: dict[tuple[str, str], dict[str, list[tuple[object, ...]]]] = {}
    for device in devices:
        for case in harness.CASES:
            ok, text, run = check_clean(case, device)
            signatures[(case, device)] = _signature(run)
            report(ok, f"{device:<4} {case}", text)
    if "cpu" in devices and "meta" in devices:
        for case in harness.CASES:
            if harness.default_num_blocks(case, "cpu") == harness.default_num_blocks(case, "meta"):
                same = signatures[(case, "cpu")] == signatures[(case, "meta")]
                report(same, f"cpu=meta {case}", "same shapes, strides, offsets, dtypes")
    for device in devices:
        for case, fault in FAULT_CASES:
            ok, text = check_fault(case, device, fault)
            report(ok, f"{device:<4} {case} +{fault}", text)
    for case in ("full_attention_lbnhc", "mla_indexer_packed", "vllm_test_worker"):
        built = harness.build(case, devices[0])
        direct = _signature(harness.run_real_worker(built))
        via = harness.run_via_connector(built)
        report(
            direct == _signature(via),
            f"{devices[0]:<4} {case} via connector",
            f"ensure_kv_transfer_initialized -> {type(via.connector).__name__}: "
            f"same {len(via.views)} views as the direct worker",
        )
    if not args.no_plugin:
        ok, text = check_plugin()
        report(ok, "plugin subprocess", text)
    failed = results.count(False)
    print(
        f"{len(results) - failed} as expected, {failed} unexpected "
        f"({time.perf_counter() - start:.1f} s after import)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
