"""Every .npy/.npz read in the agent goes through one lock (agent/npio.py): NumPy parses array headers
with `ast.literal_eval`, whose AST builder in CPython < 3.13 keeps shared state across threads, and a
golden sample was once rejected as "not a readable .npz: AST constructor recursion depth mismatch"
while 200 simulated devices updated at once (tests/fleet/test_fleet_rollout.py, 3 December 2026)."""

from __future__ import annotations

import ast
import io
import threading
from pathlib import Path

import numpy as np
import pytest

from agent import npio

AGENT = Path(__file__).resolve().parents[2] / "agent"


def _numpy_load_calls(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
                and isinstance(node.func.value, ast.Name) and node.func.value.id in ("np", "numpy")):
            lines.append(node.lineno)
    return lines


def test_no_agent_module_calls_numpy_load_outside_the_locked_reader():
    found = {str(p.relative_to(AGENT)): lines for p in AGENT.rglob("*.py")
             if p.name != "npio.py" and (lines := _numpy_load_calls(p))}
    assert not found, f"np.load outside agent/npio.py (use open_npz/read_npy): {found}"


def test_an_npz_is_read_member_by_member_under_the_lock(tmp_path: Path):
    np.savez(tmp_path / "s.npz", raw=np.arange(6).reshape(2, 3), label=np.array([1, 2]))
    with npio.open_npz(tmp_path / "s.npz") as z:
        assert npio._HEADERS.locked(), "members are parsed inside the block: the lock must cover it"
        assert sorted(z.files) == ["label", "raw"] and z["raw"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert not npio._HEADERS.locked()


def test_a_failed_read_releases_the_lock(tmp_path: Path):
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(Exception), npio.open_npz(tmp_path / "bad.npz"):
        pass
    with pytest.raises(ValueError):
        npio.read_npy(b"\x93NUMPY garbage")
    assert not npio._HEADERS.locked()


def test_npy_from_bytes_and_path_and_never_unpickled(tmp_path: Path):
    buf = io.BytesIO()
    np.save(buf, np.array([1.5, 2.5], np.float32))
    assert npio.read_npy(buf.getvalue()).tolist() == [1.5, 2.5]
    np.save(tmp_path / "a.npy", np.ones(3))
    assert npio.read_npy(tmp_path / "a.npy").sum() == 3
    obj = io.BytesIO()
    np.save(obj, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="allow_pickle"):
        npio.read_npy(obj.getvalue())


def test_threads_reading_at_once_all_get_their_arrays(tmp_path: Path):
    np.savez(tmp_path / "g.npz", **{f"a{i}": np.full((2, 2), i) for i in range(8)})
    start, errors, sums = threading.Barrier(6), [], []

    def work() -> None:
        start.wait()
        for _ in range(50):
            try:
                with npio.open_npz(tmp_path / "g.npz") as z:
                    sums.append(sum(int(z[k].sum()) for k in z.files))
            except Exception as exc:  # any failure is the race this module exists for
                errors.append(repr(exc))

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sums == [4 * sum(range(8))] * 300, errors[:3]
