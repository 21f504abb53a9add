"""Will these two engines agree? A prefill engine at TP2 and a decode engine at TP4, on CPU.

Each rank's KV cache is built as vLLM 0.33 holds it (a [blocks, heads, tokens, K|V] view per
layer, HND), described into a manifest (one JSON file per rank, in one folder per engine), and
the two folders are diffed with vLLM's NIXL rules: compatible. Then the decode engine's layer 3
is given another physical layout (NHD) under the same layout string, which vLLM's handshake
cannot see: the diff names the layer and the first byte that would arrive wrong.

Run: python examples/two_engines.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import safeview
from safeview.manifest import vllm_axes

HEADS, HEAD_SIZE, TOKENS, LAYERS = 8, 64, 16, 4


def engine(folder: Path, name: str, tp: int, blocks: int, nhd_layers: tuple[int, ...] = ()) -> None:
    folder.mkdir()
    for rank in range(tp):
        caches = {}
        for layer in range(LAYERS):
            shape = (blocks, HEADS // tp, TOKENS, 2 * HEAD_SIZE)
            if layer in nhd_layers:  # tokens outside heads: the same shape, other strides
                nhd = torch.zeros(blocks, TOKENS, HEADS // tp, 2 * HEAD_SIZE, device="meta")
                caches[f"model.layers.{layer}.self_attn"] = nhd.permute(0, 2, 1, 3)
            else:
                caches[f"model.layers.{layer}.self_attn"] = torch.zeros(shape, device="meta")
        topology = {"tp_rank": rank, "tp_size": tp, "total_kv_heads": HEADS, "engine": name,
                    "engine_version": "0.33.0", "layout": "LBHNC"}  # fmt: skip
        manifest = safeview.describe(caches, axes=vllm_axes(), topology=topology)
        (folder / manifest.file_name()).write_text(manifest.to_json())


def diff(prefill: Path, decode: Path) -> int:
    command = [sys.executable, "-m", "safeview", "diff", str(prefill), str(decode)]
    print("$ safeview diff", prefill.name, decode.name, "--rule vllm_nixl")
    result = subprocess.run([*command, "--rule", "vllm_nixl"], capture_output=True, text=True)
    print(result.stdout + result.stderr, end="")
    print(f"(exit status {result.returncode})\n")
    return result.returncode


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        engine(root / "prefill", "prefill", tp=2, blocks=100)
        engine(root / "decode", "decode", tp=4, blocks=60)
        assert diff(root / "prefill", root / "decode") == 0
        engine(root / "decode-nhd", "decode", tp=4, blocks=60, nhd_layers=(3,))
        assert diff(root / "prefill", root / "decode-nhd") == 1


if __name__ == "__main__":
    main()
