"""What a window's restore does at its two boundaries, counted on the real parts:

* ``StoreSpy``: a thin wrapper around a real ``MooncakeDistributedStore`` (LMCache's own client). Every call goes
  to the real store; the transfer calls are counted with the keys each one carried, and a test may make one raise.
  Not a fake: the bytes still move through the real client, master and segment holder.
* ``counting_writes``: the rank's destination KV tensors as a subclass view of the same storage that counts every
  write into them (``copy_``, ``index_put_``, ``index_copy_``, item assignment), from whichever thread installs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import torch

# The store's calls that move object bytes into a caller's memory (the restore's transfers).
TRANSFER_CALLS = ("batch_get_into", "get_into", "batch_get_into_multi_buffers", "batch_get_buffer", "get_batch")


class StoreSpy:
    def __init__(self, store: Any, fail_when: Callable[[Sequence[str]], bool] | None = None) -> None:
        self._store = store
        self.fail_when = fail_when
        self.calls: list[tuple[str, tuple[str, ...]]] = []  # (call, the keys it carried)
        self._lock = threading.Lock()

    @property
    def real(self) -> Any:
        return self._store

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._store, name)
        if name not in TRANSFER_CALLS:
            return real

        def counted(keys: Any, *args: Any, **kwargs: Any) -> Any:
            carried = (keys,) if isinstance(keys, str) else tuple(keys)
            with self._lock:
                self.calls.append((name, carried))
            if self.fail_when is not None and self.fail_when(carried):
                raise RuntimeError("transfer broke mid-window")
            return real(keys, *args, **kwargs)

        return counted

    def transfers_with(self, key: str) -> list[tuple[str, tuple[str, ...]]]:
        """The transfer calls that carried ``key``."""
        with self._lock:
            return [c for c in self.calls if key in c[1]]


class _CountedKV(torch.Tensor):
    """A destination KV tensor (a view of the real one's storage) that counts the writes into it."""

    writes: ClassVar[list[str]] = []
    _lock: ClassVar[threading.Lock] = threading.Lock()
    WRITES = frozenset({"copy_", "index_put_", "index_copy_", "__setitem__"})

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in cls.WRITES:
            with cls._lock:
                cls.writes.append(name)
        return super().__torch_function__(func, types, args, kwargs or {})


@contextmanager
def counting_writes(holders: Sequence[Any]) -> Iterator[list[str]]:
    """Each holder's ``kvcaches`` (an LMCache rank's per-layer KV tensors) replaced by counting views of the same
    memory while the block runs; yields the list of writes (op names) made into any of them."""
    saved = [list(h.kvcaches) for h in holders]
    _CountedKV.writes = []
    try:
        for h in holders:
            h.kvcaches[:] = [t.as_subclass(_CountedKV) for t in h.kvcaches]
        yield _CountedKV.writes
    finally:
        for h, kept in zip(holders, saved, strict=True):
            h.kvcaches[:] = kept
