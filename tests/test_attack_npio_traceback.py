"""The header lock in agent/npio.py covers the agent's own readers only. Python 3.11's traceback module
parses source with `ast.parse` to place its carets (`_extract_caret_anchors_from_line_segment`), and every
`log.exception` (structlog's format_exc_info) formats a traceback on whatever thread logged it: a read on
another thread still fails with "AST constructor recursion depth mismatch" (python/cpython#106905)."""

from __future__ import annotations

import gc
import io
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import pytest

from agent import npio

pytestmark = pytest.mark.skipif(sys.version_info >= (3, 13), reason="the shared AST depth is fixed in 3.13")


def _boom() -> int:
    return 1 + (2 * [3][5])  # a caret line: traceback parses the segment with ast.parse


def _race(read, n: int) -> list[str]:
    """`read` n times while another thread formats tracebacks; a gc callback yields the GIL mid-parse
    (what a finalizer does in a real process), so the interleaving shows within a few reads."""
    stop, errors = threading.Event(), []

    def fmt() -> None:
        while not stop.is_set():
            try:
                _boom()
            except Exception as exc:
                traceback.format_exception(exc)

    def yield_gil(phase: str, info: dict) -> None:
        if phase == "start":
            time.sleep(0)

    threshold, interval = gc.get_threshold(), sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    gc.callbacks.append(yield_gil)
    gc.set_threshold(5)
    t = threading.Thread(target=fmt, daemon=True)
    t.start()
    try:
        for _ in range(n):
            try:
                read()
            except SystemError as exc:
                errors.append(str(exc))
    finally:
        stop.set()
        t.join(10)
        gc.callbacks.remove(yield_gil)
        gc.set_threshold(*threshold)
        sys.setswitchinterval(interval)
    return errors


def test_a_npy_payload_read_while_another_thread_logs_an_exception() -> None:
    buf = io.BytesIO()
    np.save(buf, np.zeros((2, 3), np.float32))
    data = buf.getvalue()
    errors = _race(lambda: npio.read_npy(data), 1500)
    assert not errors, f"{len(errors)} of 1500 reads failed: {errors[0]}"


def test_a_golden_npz_member_read_that_meets_the_mismatch_is_read_again(tmp_path: Path, monkeypatch) -> None:
    """The interleaving is rarer for an .npz member (0-1 in 1500 here) but the same: the member's header
    parse fails once and the read must not reject the golden sample for it."""
    np.savez(tmp_path / "g.npz", raw=np.arange(4))
    real, calls = np.lib.npyio.NpzFile.__getitem__, []

    def once(self, key):
        calls.append(key)
        if len(calls) == 1:
            raise SystemError("AST constructor recursion depth mismatch (before=141, after=27)")
        return real(self, key)

    monkeypatch.setattr(np.lib.npyio.NpzFile, "__getitem__", once)
    with npio.open_npz(tmp_path / "g.npz") as z:
        assert z["raw"].tolist() == [0, 1, 2, 3] and "raw" in z.files
    with pytest.raises(SystemError, match="something else"):  # any other SystemError is not retried
        monkeypatch.setattr(np.lib.npyio.NpzFile, "__getitem__",
                            lambda self, key: (_ for _ in ()).throw(SystemError("something else")))
        with npio.open_npz(tmp_path / "g.npz") as z:
            z["raw"]
