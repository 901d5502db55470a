"""Reading .npy/.npz files from several threads at once.

NumPy parses every array header with `ast.literal_eval`. In CPython before 3.13 the AST builder keeps its
recursion depth in state shared by all threads, so two threads parsing at once can fail with
`SystemError: AST constructor recursion depth mismatch` (python/cpython#106905). Seen here: a golden
sample rejected as "not a readable .npz" on one of 200 devices updating at once in one process. The
agent parses headers on several threads (an update's loader, proof while serving, an `npy` payload on a
source thread), so every read in the agent goes through this one lock. An NpzFile parses a member's
header when the member is read, so the lock covers the whole `with` block.

The lock cannot cover AST users outside the agent's readers: Python 3.11's traceback module parses source
with `ast.parse` to place its carets, on whatever thread logs an exception (`log.exception`). The failure
is transient (the depth is reset by every parse) and a read has no side effect, so a read that meets it
is read again.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import numpy as np

_HEADERS = threading.Lock()
_MISMATCH = "AST constructor recursion depth mismatch"
_TRIES = 50  # each try fails only if another thread's parse interleaves with it
T = TypeVar("T")


def _retried(read: Callable[[], T]) -> T:
    for n in range(_TRIES):
        try:
            return read()
        except SystemError as exc:
            if _MISMATCH not in str(exc) or n == _TRIES - 1:
                raise
    raise AssertionError("unreachable")


class Npz:
    """An open .npz: its member names, and members read (and retried) on indexing."""

    def __init__(self, z: np.lib.npyio.NpzFile):
        self._z = z
        self.files: list[str] = z.files

    def __getitem__(self, key: str) -> np.ndarray:
        return _retried(lambda: self._z[key])


@contextmanager
def open_npz(path: Path | str) -> Iterator[Npz]:
    """`np.load(path, allow_pickle=False)` of an .npz, its members read inside the block."""
    with _HEADERS, np.load(path, allow_pickle=False) as z:
        yield Npz(z)


def read_npy(src: Path | str | bytes) -> np.ndarray:
    """One .npy array from a path or from bytes (a payload), never unpickled."""
    with _HEADERS:
        return _retried(lambda: np.load(io.BytesIO(src) if isinstance(src, bytes) else src, allow_pickle=False))
