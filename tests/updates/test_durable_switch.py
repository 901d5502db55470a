"""Fault: bundle files were never fsynced before `current`/`committed` switched to them, and a SIGKILL
(which keeps the page cache) cannot see that. Here the system calls of real switches are recorded
with strace, and every switch must come after the data it names is durable."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STRACE = shutil.which("strace")

pytestmark = pytest.mark.skipif(STRACE is None, reason="strace is not installed (scripts/test.sh installs it)")

DRIVER = """
import sys, shutil
from pathlib import Path
from agent.bundle.load import load_bundle
from agent.updates.store import BundleStore
from agent.testing import rewrite_manifest

store = BundleStore(Path(sys.argv[1]))
store.import_bundle(Path(sys.argv[2]))          # the seed: add + commit
staged = store.new_staging("update-")
shutil.rmtree(staged)
shutil.copytree(sys.argv[2], staged)
rewrite_manifest(staged, lambda m: m.update(version=m["version"] + 1))
bid = store.add(staged, load_bundle(staged, check_contracts=False))   # an update: add, activate, commit
store.activate(bid)
store.commit(bid)
"""

_CALL = re.compile(r'^(?:\d+\s+)?(?:\[pid\s+\d+\]\s+)?(\w+)\((.*)\)\s+=\s+(-?\d+)')
_FD_PATH = re.compile(r"<([^>]*)>")
_STR = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _trace(store: Path, bundle: Path, out: Path) -> list[tuple[str, list[str]]]:
    cmd = [STRACE, "-f", "-y", "-qq", "-s", "4096", "-o", str(out),
           "-e", "trace=fsync,fdatasync,rename,renameat,renameat2,symlink,symlinkat",
           sys.executable, "-c", DRIVER, str(store), str(bundle)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=120, env={"PYTHONPATH": str(ROOT)})
    calls = []
    for line in out.read_text().splitlines():
        m = _CALL.match(line)
        if not m or int(m.group(3)) < 0:
            continue
        name, args = m.group(1), m.group(2)
        if name in ("fsync", "fdatasync"):
            calls.append((name, _FD_PATH.findall(args)))
        else:
            calls.append((name, _STR.findall(args)))
    return calls


def switch_violations(calls: list[tuple[str, list[str]]], store: Path) -> list[str]:
    """Replay the calls: a symlink renamed into place must name a bundle whose files and directories were
    fsynced (under whatever name they had then) and whose entry in bundles/ was fsynced after it arrived."""
    durable: set[str] = set()      # paths (current names) whose data/entries were fsynced
    arrived: dict[str, bool] = {}  # bundles/<id> -> was bundles/ fsynced after its rename
    pending_link: dict[str, str] = {}  # the temporary symlink path -> its target
    problems = []
    for name, args in calls:
        if name in ("fsync", "fdatasync") and args:
            path = args[0]
            durable.add(path)
            if path == str(store / "bundles"):
                for k in arrived:
                    arrived[k] = True
        elif name.startswith("symlink"):
            pending_link[args[-1] if not args[-1].startswith("bundles") else args[1]] = args[0]
        elif name.startswith("rename") and len(args) >= 2:
            src, dst = args[0], args[1]
            if src in pending_link:  # a switch: current or committed now names the bundle
                target = store / pending_link.pop(src)
                files = [p for p in target.rglob("*") if p.is_file()] + [target]
                missing = [str(p.relative_to(store)) for p in files if str(p) not in durable]
                if missing:
                    problems.append(f"{Path(dst).name} -> {target.name} before fsync of {missing[:5]}")
                if not arrived.get(str(target), False):
                    problems.append(f"{Path(dst).name} -> {target.name} before bundles/ was fsynced after it arrived")
                continue
            durable = {dst + p[len(src):] if p == src or p.startswith(src + "/") else p for p in durable}
            if Path(dst).parent == store / "bundles":
                arrived[dst] = False
    return problems


def test_store_switch_never_precedes_the_fsync_of_the_bundle_data(tmp_path: Path, tiny_bundle_master: Path) -> None:
    store = tmp_path / "store"
    calls = _trace(store, tiny_bundle_master, tmp_path / "strace.txt")
    switches = [a for n, a in calls if n.startswith("rename") and a and a[0].endswith(".tmp")
                and Path(a[1]).name in ("current", "committed")]
    assert len(switches) == 5  # seed: current, committed; update: activate, then commit's two
    assert switch_violations(calls, store) == []


def test_the_order_check_sees_a_switch_before_the_data_is_durable(tmp_path: Path) -> None:
    """The checker itself must be able to fail: a bundle renamed in and pointed at with no fsync."""
    store = tmp_path / "store"
    b = store / "bundles" / "x-v1"
    b.mkdir(parents=True)
    (b / "bundle.yaml").write_text("x")
    calls = [("renameat2", [str(store / "staging" / "tmp1"), str(b)]),
             ("symlink", ["bundles/x-v1", str(store / ".current.tmp")]),
             ("renameat2", [str(store / ".current.tmp"), str(store / "current")])]
    problems = switch_violations(calls, store)
    assert problems and "before fsync of" in problems[0]
