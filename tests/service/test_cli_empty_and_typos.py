"""The smaller newcomer edges (issue 18), each one line: an empty store or an empty broker is said, not an empty
screen; `bundle activate nope` names the store (not an archive); a typo'd config key gets "did you mean";
`report nope.json` says there is no such file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from brokers import Broker

ROOT = Path(__file__).resolve().parents[2]


def edge_agent(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("edge-agent"), err
    return lines[0]


def test_bundle_list_of_an_empty_store_says_so(tmp_path: Path) -> None:
    (tmp_path / "store" / "bundles").mkdir(parents=True)
    out = edge_agent("bundle", "list", "--state-dir", str(tmp_path))
    assert out.returncode == 0 and out.stdout == ""
    assert f"no bundles in the store {tmp_path / 'store' / 'bundles'}" in _one_line(out.stderr)


def test_bundle_list_of_a_mistyped_state_dir_says_so_and_creates_nothing(tmp_path: Path) -> None:
    typo = tmp_path / "sate"
    out = edge_agent("bundle", "list", "--state-dir", str(typo))
    assert out.returncode == 0 and out.stdout == ""
    assert "there is no store there" in _one_line(out.stderr)
    assert not typo.exists()


def test_bundle_activate_of_an_unknown_id_names_the_store_not_an_archive(tmp_path: Path) -> None:
    out = edge_agent("bundle", "activate", "nope", "--state-dir", str(tmp_path))
    assert out.returncode == 2
    line = _one_line(out.stderr)
    assert f"no bundle 'nope' in the store {tmp_path / 'store' / 'bundles'} (it holds: none)" in line
    assert "bundle list" in line and "unpack" not in line and ".tar.gz" not in line


def test_bundle_activate_takes_an_id_never_a_path(tmp_path: Path) -> None:
    out = edge_agent("bundle", "activate", "../../digits-classifier", "--state-dir", str(tmp_path))
    assert out.returncode == 2 and "no bundle '../../digits-classifier' in the store" in _one_line(out.stderr)


def test_monitor_of_an_empty_broker_says_so(tmp_path: Path) -> None:
    broker = Broker(tmp_path / "broker").start()
    try:
        text = edge_agent("monitor", "--broker", f"127.0.0.1:{broker.port}", "--once", "--wait", "0.5")
        js = edge_agent("monitor", "--broker", f"127.0.0.1:{broker.port}", "--once", "--wait", "0.5", "--json")
    finally:
        broker.stop()
    want = f"edge-agent monitor: no devices under edge/<device>/ on 127.0.0.1:{broker.port} after 0.5 s"
    assert text.returncode == 0 and want in _one_line(text.stderr)
    assert js.returncode == 0 and json.loads(js.stdout) == [] and want in _one_line(js.stderr)


def test_a_typod_config_key_gets_did_you_mean(tmp_path: Path) -> None:
    cfg = tmp_path / "a.yaml"
    cfg.write_text("devce_id: d1\n")
    assert "key devce_id: unknown key; did you mean 'device_id'? (known here:" in _one_line(
        edge_agent("config", "check", str(cfg)).stderr)
    cfg.write_text("source: {type: folder, max_fsp: 5}\n")
    assert "key source.max_fsp: unknown key; did you mean 'source.max_fps'? (known here:" in _one_line(
        edge_agent("config", "check", str(cfg)).stderr)
    cfg.write_text("zzzzqqq: 1\n")  # nothing close: no made-up suggestion
    line = _one_line(edge_agent("config", "check", str(cfg)).stderr)
    assert "key zzzzqqq: unknown key (known here:" in line and "did you mean" not in line


def test_report_of_a_missing_file_says_no_such_file(tmp_path: Path) -> None:
    out = edge_agent("report", str(tmp_path / "nope.json"))
    assert out.returncode == 1
    assert _one_line(out.stderr).startswith(f"edge-agent: {tmp_path / 'nope.json'}: no such file or directory; ")
