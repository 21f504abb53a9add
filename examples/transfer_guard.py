"""Guarding a transfer engine: NIXL and Mooncake, for real, on this machine's CPU.

A KV cache of two layers (8 blocks of 256 bytes each) is registered with each engine through
safeview's guard. A clean transfer of whole pages moves; a row that carries another layer's
block length (vLLM issue 57661: half of each page) is refused under strict before the engine sees
it, and under warn moved with an ``address_violation`` event. Told which layer each row is for
(``layers=``), the guard also refuses a row of whole pages of the wrong layer.

Needs numpy and the engines (from a checkout: ``pip install -e ".[transfer]"``, then the lines
in ``INSTALL`` below); an engine that is not installed, or does not load, is skipped, and the
script says which, why, and the exact install lines that would run it.

NIXL's UCX backend may crash the interpreter when it exits (a segmentation fault, exit status
139, after everything ran), with or without safeview. This script therefore leaves with
``os._exit`` once its output is flushed; do the same at the end of a script that uses NIXL.

Run: python examples/transfer_guard.py
"""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import torch

import safeview
from safeview.kv import block_views

PAGE, BLOCKS, LAYERS = 256, 8, 2

#: the versions safeview is tested with, on a CPU torch (a CUDA 13 torch, as vLLM 0.33 brings,
#: needs nixl-cu13==1.5.1 in place of nixl-cu12)
INSTALL = {
    "NIXL": ("pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1",),
    "Mooncake": (
        "sudo apt-get install libibverbs1",
        "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1",
    ),
}


def kv_cache() -> tuple[torch.Tensor, object]:
    """Two layers one after the other in one storage, and their checked block views."""
    kv = (torch.arange(LAYERS * BLOCKS * PAGE) % 251 + 1).to(torch.int8)
    layer_bytes = BLOCKS * PAGE
    caches = {
        f"layers.{n}": kv[n * layer_bytes : (n + 1) * layer_bytes].view(BLOCKS, PAGE)
        for n in range(LAYERS)
    }
    return kv, block_views(caches, dict.fromkeys(caches, PAGE), num_blocks=BLOCKS)


def nixl_example() -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    from safeview.transfer import nixl

    kv, registration = kv_cache()
    destination = torch.zeros_like(kv)
    config = nixl_agent_config(backends=["UCX"])
    agent = nixl.guard(nixl_agent("sender", config), registration, layers="views")
    peer = nixl_agent("receiver", config)
    agent.register_memory([(kv.data_ptr(), kv.numel(), 0, "")], "DRAM")
    peer.register_memory([(destination.data_ptr(), destination.numel(), 0, "")], "DRAM")
    name = agent.add_remote_agent(peer.get_agent_metadata())

    def rows(base: int, lengths: tuple[int, ...]) -> np.ndarray:
        """One strided row per layer: (address, length, device, stride, count)."""
        return np.array(
            [[base + n * BLOCKS * PAGE, lengths[n], 0, PAGE, BLOCKS] for n in range(LAYERS)],
            dtype=np.uint64,
        )

    def write(local_rows: np.ndarray) -> str:
        """Prepare both sides with the same lengths (as vLLM does) and write blocks 0 of each
        layer; the peer's list holds the peer's addresses and is not checked."""
        lengths = tuple(int(length) for length in local_rows[:, 1])
        remote = agent.prep_xfer_dlist(name, rows(destination.data_ptr(), lengths), "DRAM")
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_rows, "DRAM")
        handle = agent.make_prepped_xfer("WRITE", local, [0, BLOCKS], remote, [0, BLOCKS], b"x")
        state = agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = agent.check_xfer_state(handle)
        return str(state)

    print("NIXL, whole pages:", write(rows(kv.data_ptr(), (PAGE, PAGE))))
    shared = rows(kv.data_ptr(), (PAGE, PAGE // 2))  # layer 1 with half a page
    try:
        write(shared)
    except safeview.AddressError as error:
        print("NIXL, strict:", error.kind, "-", error.layers)
    with safeview.policy_scope("warn"):
        print("NIXL, warn: moved anyway:", write(shared))
    swapped = rows(kv.data_ptr(), (PAGE, PAGE))[::-1].copy()  # layer 1's row first
    try:
        write(swapped)
    except safeview.AddressError as error:
        print("NIXL, rows in the wrong order:", error.kind, "- meant for", repr(error.layer))


def mooncake_example() -> None:
    from mooncake.engine import TransferEngine

    from safeview.transfer import mooncake

    kv, registration = kv_cache()
    destination = torch.zeros_like(kv)
    local, remote = TransferEngine(), TransferEngine()
    for engine in (local, remote):
        engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    engine = mooncake.guard(local, registration)  # a proxy: use it in the engine's place
    engine.register_memory(kv.data_ptr(), kv.numel())
    remote.register_memory(destination.data_ptr(), destination.numel())
    peer = f"127.0.0.1:{remote.get_rpc_port()}"
    status = engine.transfer_sync_write(peer, kv.data_ptr(), destination.data_ptr(), PAGE)
    print("Mooncake, one whole page: status", status)
    try:  # half of page 0 and half of page 1
        engine.transfer_sync_write(peer, kv.data_ptr() + PAGE // 2, destination.data_ptr(), PAGE)
    except safeview.AddressError as error:
        print("Mooncake, strict:", error.kind, "-", error.layers)


def main() -> None:
    safeview.configure_logging("console", level="WARNING", stream=sys.stdout)
    skipped: list[tuple[str, str]] = []
    with safeview.policy_scope("strict"):
        for engine, module, run in (
            ("NIXL", "nixl._api", nixl_example),
            ("Mooncake", "mooncake.engine", mooncake_example),
        ):
            try:
                importlib.import_module(module)
            except ImportError as error:  # not installed, or a library it needs is missing
                missing = isinstance(error, ModuleNotFoundError) and error.name is not None
                why = "not installed" if missing else f"does not load ({error})"
                print(f"{engine}: SKIPPED, {why}")
                skipped.append((engine, why))
                continue
            run()
    if skipped:
        print()
        print(f"Skipped {len(skipped)} of 2 engines; to run them too:")
        for engine, why in skipped:
            print(f"  {engine} ({why}):")
            for line in INSTALL[engine]:
                print(f"    {line}")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # NIXL's UCX may crash the interpreter at exit (status 139): leave now
