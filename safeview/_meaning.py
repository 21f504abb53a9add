"""What one page byte means to one side of a transfer (``safeview.diff``): plain data, the words
a diff finding uses for it. Imports nothing of safeview."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Meaning"]


@dataclass(frozen=True)
class Meaning:
    """What one byte means to one side: K or V (``kv`` 0 or 1, None for a latent or state
    byte), token in the receiver's block, global head (None for a latent), element, byte of
    the element; ``status`` ``padding`` for a byte no axis reaches, ``outside`` for one past
    the page (another block's, another layer's); ``block`` under ``in_place``."""

    status: Literal["data", "padding", "outside", "unfilled"]
    kv: int | None = None
    token: int | None = None
    head: int | None = None
    element: int | None = None
    byte: int = 0
    block: int | None = None
    dtype: str | None = None

    def words(self) -> str:
        if self.status == "padding":
            return "padding"
        if self.status == "outside":
            return "a byte outside its page"
        if self.status == "unfilled":
            return "nothing (the transfer never fills it)"
        parts = [] if self.block is None else [f"block {self.block}"]
        if self.kv is not None:
            parts.append("KV"[self.kv])
        parts.append(f"token {self.token}")
        if self.head is not None:
            parts.append(f"head {self.head}")
        parts.append(f"element {self.element}")
        if self.byte:
            parts.append(f"byte {self.byte}")
        return " ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "block": self.block,
            "kv": None if self.kv is None else "KV"[self.kv],
            "token": self.token,
            "head": self.head,
            "element": self.element,
            "byte": self.byte,
            "dtype": self.dtype,
            "words": self.words(),
        }
