"""The sentences of ``Finding``'s diff kinds (``safeview.diff``: two manifests that read a layer's
bytes differently), one constructor per kind. Part of ``safeview.findings`` (a base class of
``Finding``, so that ``Finding.diff_byte(...)`` and the rest read as its own constructors), kept
in a module of its own to hold each module under 800 lines. Imports nothing of safeview when it
is loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, cast

if TYPE_CHECKING:
    from safeview._meaning import Meaning
    from safeview.findings import Finding, Kind

__all__ = ["DiffFindings"]


def _n(number: int) -> str:
    return f"{number:,}"


def _finding(finding: Any, kind: Kind, layer: str | None, message: str, **numbers: Any) -> Finding:
    """A ``finding`` (``Finding`` itself: these are its classmethods, so this module needs no
    import of it) of ``kind`` about ``layer``."""
    views = (layer,) if layer is not None else ()
    return cast("Finding", finding(kind, views, None, message, layer=layer, **numbers))


class DiffFindings:
    """The diff constructors of ``Finding``: each builds a finding of one kind, with its one
    sentence and its numbers (``layer``, ``byte``, ``block``, ``receiver_rank``,
    ``sender_ranks``, ``receiver_reads``, ``sender_wrote``)."""

    __slots__ = ()

    @classmethod
    def diff_byte(
        cls,
        layer: str,
        *,
        byte: int,
        receiver_reads: Meaning,
        sender_wrote: Meaning,
        receiver_rank: int,
        sender_ranks: tuple[int, ...],
        block: int | None = None,
        where: str = "",
    ) -> Finding:
        """Receiver page byte ``byte`` (of block ``block``'s page, when the receiver reads the
        sender's memory in place) reads ``receiver_reads``; the sender wrote ``sender_wrote``
        there. ``where`` names the ranks, in words, when a side has several."""
        page = "receiver page byte" if block is None else f"block {block}'s page byte"
        return _finding(
            cls,
            "byte",
            layer,
            f"{layer}: {page} {_n(byte)} reads {receiver_reads.words()}, the sender wrote "
            f"{sender_wrote.words()} there{where}",
            byte=byte,
            block=block,
            receiver_rank=receiver_rank,
            sender_ranks=sender_ranks,
            receiver_reads=receiver_reads,
            sender_wrote=sender_wrote,
        )

    @classmethod
    def diff_past_page(
        cls,
        layer: str,
        *,
        sender_page_bytes: int,
        receiver_page_bytes: int,
        receiver_rank: int,
        sender_ranks: tuple[int, ...],
        where: str = "",
    ) -> Finding:
        """A page copy of the sender's larger page writes past each receiver page (``byte``:
        the receiver's page size, the first byte written past it)."""
        past = sender_page_bytes - receiver_page_bytes
        return _finding(
            cls,
            "byte",
            layer,
            f"{layer}: the sender's page is {_n(sender_page_bytes)} bytes, the receiver's "
            f"{_n(receiver_page_bytes)}: a page copy writes {_n(past)} bytes past each receiver "
            f"page{where}",
            byte=receiver_page_bytes,
            receiver_rank=receiver_rank,
            sender_ranks=sender_ranks,
        )

    @classmethod
    def diff_dtype(
        cls,
        layer: str,
        *,
        reads: str,
        wrote: str,
        receiver_rank: int,
        sender_ranks: tuple[int, ...],
        where: str = "",
    ) -> Finding:
        """The receiver reads ``reads`` elements where the sender wrote ``wrote``."""
        return _finding(
            cls,
            "dtype",
            layer,
            f"{layer}: the receiver reads {reads}, the sender wrote {wrote}{where}",
            byte=0,
            receiver_rank=receiver_rank,
            sender_ranks=sender_ranks,
        )

    @classmethod
    def missing_layer(cls, layer: str, *, side: Literal["sender", "receiver"]) -> Finding:
        """Only ``side`` has ``layer``: layers are paired by name, never by position."""
        return _finding(cls, "missing_layer", layer, f"{layer}: only the {side} has this layer")

    @classmethod
    def missing_rank(
        cls,
        layer: str | None,
        *,
        rank: int,
        receiver_rank: int | None,
        sender_ranks: tuple[int, ...] = (),
        where: str = "",
        side: Literal["sender", "receiver"] = "sender",
        tp_size: int | None = None,
    ) -> Finding:
        """No ``side`` manifest for ``rank`` (``layer`` None; ``tp_size`` the TP size that side
        declares), or the rank-``rank`` sender manifest that ``layer`` of ``receiver_rank``
        reads from (or its layer) is missing."""
        if layer is None and tp_size is not None:
            judged = "is not judged" if side == "receiver" else "is read by no receiver rank judged"
            message = (
                f"the {side} declares TP {tp_size} but no manifest of its rank {rank} was "
                f"given: rank {rank} {judged}"
            )
        elif layer is None:
            message = f"no {side} manifest for rank {rank}"
        else:
            message = f"{layer}: the sender's rank {rank} manifest (or its layer) is missing{where}"
        return _finding(
            cls,
            "missing_rank",
            layer,
            message,
            receiver_rank=receiver_rank,
            sender_ranks=sender_ranks,
        )

    @classmethod
    def refused(
        cls, layer: str, *, connector: str, reason: str, receiver_rank: int, where: str = ""
    ) -> Finding:
        """``connector`` itself refuses to move ``layer`` between the two sides: ``reason``."""
        return _finding(
            cls,
            "refused",
            layer,
            f"{layer}: {connector} refuses this pair: {reason}{where}",
            receiver_rank=receiver_rank,
        )
