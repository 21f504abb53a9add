"""Which vLLM setting mends a refused P/D pair, and on which side: the sentence a refusal ends
with, where there is such a setting.

A refusal says what differs (the first ``safeview.diff`` finding: a layer, a byte, what each
side means by it); an operator also needs the knob. ``setting_for`` reads the two engines'
manifests at that finding (element type, page order, block tokens, TP size, state layers) and
names vLLM 0.33's setting: ``--kv-cache-dtype``, ``--block-size``, ``VLLM_KV_CACHE_LAYOUT`` or
``kv_transfer_config.enable_permute_local_kv``, ``VLLM_SSM_CONV_STATE_LAYOUT``,
``--tensor-parallel-size`` and the request's ``tp_size``. Pure: no vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from safeview.manifest import Manifest

__all__ = ["setting_for"]


def _layer(manifests: Sequence[Manifest], name: str | None) -> Any:
    for manifest in manifests:
        if name is not None and name in manifest.layers:
            return manifest.layers[name]
    return None


def setting_for(finding: Any, receiver: Manifest, senders: Sequence[Manifest]) -> str | None:
    """The vLLM setting that would make D (``receiver``) read P's (``senders``) pages as P
    wrote them at ``finding``, and on which engine to set it; ``None`` where no setting does
    (two engines that lay a layer out otherwise behind the same names: a bug, not a knob)."""
    if not senders:
        return None
    mine, theirs = receiver.topology, senders[0].topology
    name = getattr(finding, "layer", None)
    d_layer, p_layer = _layer([receiver], name), _layer(senders, name)
    kind = getattr(finding, "kind", None)
    if d_layer is not None and p_layer is not None and d_layer.dtype != p_layer.dtype:
        return (
            f"the KV cache dtype: D stores {name} as {d_layer.dtype}, P as {p_layer.dtype}; "
            "set --kv-cache-dtype (cache_config.cache_dtype) alike on both engines"
        )
    if "state" in (getattr(d_layer, "kind", None), getattr(p_layer, "kind", None)):
        return (
            "the Mamba conv state layout: set VLLM_SSM_CONV_STATE_LAYOUT (SD or DS) alike in "
            "both engines' environment"
        )
    if mine.layout and theirs.layout and mine.layout != theirs.layout:
        return (
            f"the KV cache layout: D holds {mine.layout}, P {theirs.layout}; on D, set "
            f"VLLM_KV_CACHE_LAYOUT to P's, or kv_transfer_config.enable_permute_local_kv "
            "(vLLM permutes P's pages on receipt)"
        )
    d_tokens, p_tokens = mine.logical_block_tokens, theirs.logical_block_tokens
    if d_tokens and p_tokens and d_tokens % p_tokens:
        return (
            f"the block size: D's blocks hold {d_tokens} tokens, P's {p_tokens}; on D, set "
            "--block-size to a multiple of P's"
        )
    if kind in ("missing_rank", "refused") and mine.tp_size != theirs.tp_size:
        return (
            f"the TP size: D (TP {mine.tp_size}) reads P as TP {theirs.tp_size}; set "
            "--tensor-parallel-size on P to one D can pair with, and have the proxy relay P's "
            "kv_transfer_params (tp_size) verbatim"
        )
    if kind == "missing_layer":
        return "the model: P and D serve different layers; start both engines on the same model"
    return None
