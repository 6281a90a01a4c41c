"""Start-up helpers of the serving process: the garbage collector through start-up, and
work started on a thread of its own (see ``bargein serve`` in :mod:`bargein.cli`; the
collector is paused by ``Engine.from_pretrained`` too)."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """The cyclic garbage collector off inside, back as it was after.

    Start-up builds a quarter of a million objects that live as long as the server (torch's
    and the server's modules, the vocabulary, the model) and little cyclic garbage; the
    collector, run every few hundred allocations, walks that growing heap again and again:
    ~0.3 CPU seconds of a start-up (measured: serve on SmolLM2-135M)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def settle_heap() -> None:
    """One full collection, then what survives frozen.

    What exists once the server is built (the modules, the model, the tokenizer, the app)
    lives as long as the server. Frozen, the collector no longer walks it in every full
    collection, a pause that stops every thread, the engine's and the event loop's (~300 ms
    on 2 cores). Called while :func:`collection_paused`: with the collector back on first,
    its first automatic collection would walk all of it once more (~0.2 CPU-s)."""
    gc.collect()
    gc.freeze()


class InBackground(Generic[T]):
    """``fn()`` run on a daemon thread of its own; :meth:`result` waits for it and returns its
    value or raises its exception in the caller's thread. Daemon: a process that ends
    early (an error, a Ctrl-C) does not wait for ``fn``, so ``fn`` must be safe to stop
    anywhere (Python code, not a torch operation)."""

    def __init__(self, fn: Callable[[], T], name: str):
        self._fn = fn
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._fn()
        except BaseException as exc:  # handed to the waiting thread, which raises it
            self._error = exc

    def result(self) -> T:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]
