"""Work the vLLM plugin does beside vLLM's own threads: one daemon thread per use, each call's
outcome in a ``Future`` (D's judgement of P's handshake manifest while NIXL loads P's agent; D's
fetch of P's digests has its own thread, ``_digest.DigestFetcher``)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["Background"]


class Background:
    """One daemon thread that runs what is submitted, in turn, each call's outcome in a
    ``Future``. A daemon, so that work still waiting on a peer never holds up the host's exit,
    which a ``ThreadPoolExecutor``'s worker would: the interpreter joins those at exit."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = (
            queue.SimpleQueue()
        )
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def start(self) -> None:
        """Start the thread now, if it is not running (else the first ``submit`` does): a
        thread takes a while to start on a busy machine, which is better paid at start-up."""
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self.thread.start()

    def submit(self, function: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        if self.thread is None:
            self.start()
        self.queue.put((future, function, args))
        return future

    def _run(self) -> None:
        while True:
            self._one(*self.queue.get())  # nothing of a call is kept while the next is awaited

    @staticmethod
    def _one(future: Future[Any], function: Callable[..., Any], args: tuple[Any, ...]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(function(*args))
        except BaseException as error:  # the caller reads it from the future
            future.set_exception(error)
