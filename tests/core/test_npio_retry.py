"""The header lock in agent/npio.py covers the agent's own readers only. Python 3.11's traceback module
parses source with `ast.parse` to place its carets (`_extract_caret_anchors_from_line_segment`), and every
`log.exception` (structlog's format_exc_info) formats a traceback on whatever thread logged it: a read on
another thread still fails with "AST constructor recursion depth mismatch" (python/cpython#106905)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import pytest

from agent import npio

pytestmark = pytest.mark.skipif(sys.version_info >= (3, 13), reason="the shared AST depth is fixed in 3.13")


def test_a_npy_payload_read_that_meets_the_mismatch_is_read_again(monkeypatch) -> None:
    """The interleaving itself is a race (forced with a 1 us switch interval and a GIL yield in every
    collection, 513 of 1500 unretried reads failed; unforced, 0 of 5000): injected here, so the test is
    the same on every run. A read that meets it is read again; any other SystemError is not."""
    buf = io.BytesIO()
    np.save(buf, np.zeros((2, 3), np.float32))
    data, real, calls = buf.getvalue(), np.load, []

    def once(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise SystemError("AST constructor recursion depth mismatch (before=147, after=26)")
        return real(*a, **k)

    monkeypatch.setattr(np, "load", once)
    assert npio.read_npy(data).shape == (2, 3) and len(calls) == 2
    monkeypatch.setattr(np, "load", lambda *a, **k: (_ for _ in ()).throw(SystemError("something else")))
    with pytest.raises(SystemError, match="something else"):
        npio.read_npy(data)


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
