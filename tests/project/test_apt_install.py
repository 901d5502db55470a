"""scripts/test.sh on a fresh machine: another apt holding the lock (unattended-upgrades after a boot) is waited
for, bounded and said, never a death in 4 s (`E: Could not get lock`, rc 100); what apt installs and upgrades is said
before it does it. A stand-in `apt-get` first in PATH plays the locked apt; the real script runs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAKE_APT = """#!/usr/bin/env bash
# A stand-in apt-get: `update` is locked for the first LOCKED calls; `install -s` plans; `install` records.
calls={calls}
n=$(( $(cat "$calls" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$calls"
echo "$*" >> {log}
case " $* " in
  *" update "*) if [ "$n" -le {locked} ]; then
                  echo "E: Could not get lock /var/lib/apt/lists/lock. It is held by process 812 (apt-get)" >&2
                  exit 100
                fi ;;
  *" -s "*) echo "Inst mosquitto (2.0.11-1.2+deb12u1 Debian:12.9/stable [amd64])"
            echo "Inst systemd [252.38-1~deb12u1] (252.39-1~deb12u1 Debian:12.9/stable [amd64])" ;;
esac
exit 0
"""


def _run(tmp: Path, locked: int, wait_s: int) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "apt-get"
    fake.write_text(FAKE_APT.format(calls=tmp / "calls", log=tmp / "log", locked=locked))
    fake.chmod(0o755)
    for name in ("sudo",):  # as root no sudo is used; elsewhere a stand-in that runs the command
        (bin_dir / name).write_text('#!/usr/bin/env bash\nexec "$@"\n')
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "APT_WAIT": str(wait_s), "APT_RETRY_S": "0.05"}
    return subprocess.run(["bash", str(ROOT / "scripts" / "apt_install.sh"), "mosquitto", "systemd-container"],
                          capture_output=True, text=True, env=env, timeout=60)


def test_a_held_apt_lock_is_waited_for_and_said_then_the_packages_install(tmp_path: Path) -> None:
    out = _run(tmp_path, locked=3, wait_s=30)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("waiting up to") == 1, out.stderr  # said once, not per try
    calls = (tmp_path / "log").read_text().splitlines()
    assert len([c for c in calls if "update" in c]) == 4  # three refused, the fourth went through
    assert any("install -y" in c for c in calls), calls
    # what it does to the machine, before it does it
    assert "new: mosquitto" in out.stderr and "upgraded on the way: systemd (from 252.38-1~deb12u1)" in out.stderr


def test_a_lock_held_past_the_bound_fails_with_apts_own_message(tmp_path: Path) -> None:
    out = _run(tmp_path, locked=10**6, wait_s=1)
    assert out.returncode == 100
    assert "Could not get lock" in out.stderr and "waiting up to" in out.stderr
