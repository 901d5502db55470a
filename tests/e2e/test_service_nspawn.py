"""The service under real systemd: a debootstrapped Debian booted with `systemd-nspawn -b`, systemd as
PID 1, `scripts/install.sh` run inside it, then readiness, reload, stop, crash, watchdog, state and
uninstall checked through systemctl, the journal and a Mosquitto broker inside the container.

Run by scripts/test.sh as its own step (`-m nspawn -s`) so each step prints. Needs root, debootstrap
and systemd-container; the root file system and a wheelhouse are cached under ~/.cache/edge-agent.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("EDGE_AGENT_CACHE", Path.home() / ".cache" / "edge-agent"))
ROOTFS = CACHE / "nspawn-bookworm"
WHEELS = CACHE / "wheelhouse"
PACKAGES = "systemd,systemd-sysv,dbus,python3,python3-venv,mosquitto,mosquitto-clients,ca-certificates,procps"

HAVE = os.geteuid() == 0 and shutil.which("systemd-nspawn") and shutil.which("debootstrap") and shutil.which("nsenter")
pytestmark = [
    pytest.mark.nspawn,
    pytest.mark.slow,
    pytest.mark.skipif(not HAVE and not os.environ.get("CI"),
                       reason="needs root, systemd-nspawn and debootstrap (scripts/test.sh installs them)"),
]


def step(msg: str) -> None:
    print(f"\n[nspawn] {msg}", flush=True)


def prepared() -> tuple[Path, Path]:
    """The root file system and the wheelhouse, made under one lock: scripts/test.sh runs this file's tests in
    two processes at once, and two builds of one cache would trample each other."""
    import fcntl

    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".nspawn-prepare.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return ensure_rootfs(), ensure_wheels()


def ensure_rootfs(rootfs: Path = ROOTFS, packages: str = PACKAGES, arch: str | None = None) -> Path:
    """A Debian bookworm root with `packages` (cached: built again only when the list changes); `arch`: another
    architecture's (tests/arm64_root.py), run under qemu-user."""
    marker = rootfs / ".edge-agent-packages"
    if marker.exists() and marker.read_text() == packages:
        return rootfs
    step(f"debootstrap bookworm{f' ({arch})' if arch else ''} into {rootfs} (cached for later runs)")
    tmp = rootfs.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run(["debootstrap", *([f"--arch={arch}"] if arch else []), "--variant=minbase", f"--include={packages}",
                    "bookworm", str(tmp), "http://deb.debian.org/debian"], check=True, stdout=subprocess.DEVNULL)
    (tmp / ".edge-agent-packages").write_text(packages)
    shutil.rmtree(rootfs, ignore_errors=True)
    tmp.rename(rootfs)
    return rootfs


# dot-folders too: the checkout's .git, and the caches ruff, mypy and pytest write in every run (a hash over
# them would never match the last run's)
_NOT_BUILT = shutil.ignore_patterns(".*", "state", "build", "*.egg-info", "calibration", "tests", "__pycache__",
                                    "*.pyc")


def source_key() -> str:
    """What the agent's wheel is built from, by content: every file `ensure_wheels` copies, path and bytes."""
    import hashlib

    h = hashlib.sha256()
    for top, dirs, files in os.walk(ROOT):
        skip = _NOT_BUILT(top, dirs + files)
        dirs[:] = sorted(d for d in dirs if d not in skip)
        for name in sorted(f for f in files if f not in skip):
            path = Path(top, name)
            h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def ensure_wheels() -> Path:
    """Wheels for the container's Python 3.11: the dependencies (cached) and this checkout's agent, built
    again only when its sources changed (6 s a build on 2 cores, once per test before)."""
    WHEELS.mkdir(parents=True, exist_ok=True)
    stamp, key = WHEELS / ".edge-agent-source", source_key()
    if any(WHEELS.glob("edge_agent*-*.whl")) and stamp.exists() and stamp.read_text() == key:
        step(f"wheelhouse: the agent's wheel is built from these sources already ({key})")
        return WHEELS
    stamp.unlink(missing_ok=True)  # first: a build cut short never leaves the old stamp beside a new wheel
    for old in WHEELS.glob("edge_agent*-*.whl"):
        old.unlink()
    step("building the wheelhouse (dependencies cached, the agent rebuilt)")
    build = CACHE / "wheel-build"
    shutil.rmtree(build, ignore_errors=True)
    shutil.copytree(ROOT, build, ignore=_NOT_BUILT)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "-w", str(WHEELS),
                    str(build)], check=True)
    shutil.rmtree(build, ignore_errors=True)
    stamp.write_text(key)
    return WHEELS


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(k) for t in Path(f"/proc/{p}/task").iterdir()
                    for k in (t / "children").read_text().split()]
        except OSError:
            continue
        out += kids
        todo += kids
    return out


def container_init(nspawn_pid: int) -> int:
    """The container's PID 1 (systemd), seen from the host: the descendant of systemd-nspawn whose
    `NSpid` ends in 1. The first child of systemd-nspawn is a short-lived helper, not the container."""
    for pid in _descendants(nspawn_pid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
        if len(nspid) >= 2 and nspid[-1] == "1":
            return pid
    return 0


class Container:
    def __init__(self, rootfs: Path, binds: dict[Path, str], name: str):
        # --volatile=overlay: the cached root read-only under a tmpfs that takes every write, gone with the
        # container. (--ephemeral copied the 308 MB root on this ext4 disk at each boot: 7 s of the 7.7 s.)
        # a machine name of its own: two containers of the one root run at once (scripts/test.sh)
        args = ["systemd-nspawn", "-q", "-D", str(rootfs), f"--machine={name}", "--volatile=overlay", "--register=no",
                "--keep-unit", "--private-network", "-b"]
        for host, inside in binds.items():
            args.append(f"--bind-ro={host}:{inside}")
        self.log = open(CACHE / f"nspawn-console-{name}.log", "w")
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait_booted()
        except BaseException:
            self.stop()
            raise

    def _wait_booted(self) -> None:
        self.leader = 0
        end = time.monotonic() + 60
        while time.monotonic() < end and self.proc.poll() is None:
            self.leader = container_init(self.proc.pid)
            if self.leader and self.sh("true", check=False).returncode == 0:
                break
            time.sleep(0.2)
        assert self.leader, f"systemd-nspawn did not start the container (exit {self.proc.poll()})"
        end = time.monotonic() + 120
        while time.monotonic() < end:
            state = self.sh("systemctl is-system-running", check=False).stdout.strip()
            if state in ("running", "degraded"):
                return
            time.sleep(0.5)
        raise AssertionError(f"the container's systemd did not finish booting: {state}")

    def sh(self, cmd: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        out = subprocess.run(["nsenter", "-t", str(self.leader), "-a", "/bin/sh", "-c", cmd],
                             capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"`{cmd}` failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        return out

    def prop(self, name: str) -> str:
        return self.sh(f"systemctl show -p {name} --value edge-agent").stdout.strip()

    def wait_for(self, pred, timeout: float = 120, what: str = "") -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if pred():
                return
            time.sleep(0.3)
        journal = self.sh("journalctl -u edge-agent --no-pager -n 40", check=False).stdout
        raise AssertionError(f"timed out waiting for {what}\n{journal}")

    def stop(self) -> None:
        """Shut the container down (its writes, in a tmpfs over the read-only root, go with it); force it if it
        hangs."""
        if self.proc.poll() is None:
            self.proc.terminate()  # systemd-nspawn asks the container's systemd to power off
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                leader = container_init(self.proc.pid)
                if leader:
                    os.kill(leader, 9)  # PID 1 gone: nspawn tears down and still cleans up
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self.log.close()


def listing(c: Container) -> set[str]:
    """Every path on the container's root file system outside runtime and cache areas."""
    out = c.sh("find / -xdev \\( -path /proc -o -path /sys -o -path /dev -o -path /run -o -path /tmp "
               "-o -path /var/tmp -o -path /var/log/journal -o -path /var/cache -o -path /var/lib/systemd "
               "-o -path /var/lib/mosquitto -o -path /root/.cache \\) -prune -o -print").stdout
    return set(out.splitlines())


AGENT_YAML = """
device_id: nspawn-dev
state_dir: /var/lib/edge-agent
bundle: /opt/edge-agent/share/models/digits-classifier
source: {type: folder, path: /opt/edge-agent/share/models/demo-frames/digits, loop: true, max_fps: 20}
output: {stdout: false, health_interval_s: 2}
mqtt: {enabled: true, host: 127.0.0.1, port: 1883, reconnect_min_s: 1, reconnect_max_s: 2}
"""

HUNG_CAMERA = """
source: {type: stream, url: "http://127.0.0.1:8554/cam.mjpg", open_timeout_ms: 600000, read_timeout_ms: 600000}
"""


def install(c: Container, agent_yaml: str, service: list[str]) -> None:
    """scripts/install.sh from the wheelhouse (not started), the agent's config, and a drop-in with
    `service` lines for the unit's [Service] section."""
    step("scripts/install.sh --wheelhouse /wheels --no-start")
    out = c.sh("/src/scripts/install.sh --wheelhouse /wheels --no-start", timeout=600)
    assert "installed:" in out.stdout
    assert c.sh("systemctl is-enabled edge-agent").stdout.strip() == "enabled"
    c.sh(f"cat > /etc/edge-agent/agent.yaml <<'EOF'\n{agent_yaml}\nEOF")
    dropin(c, service)
    c.sh("systemctl is-active mosquitto")


def dropin(c: Container, service: list[str]) -> None:
    """The test's drop-in for the unit's [Service] section (replaced), and systemd told of it."""
    text = "\n".join(["[Service]", *service, ""])
    c.sh("mkdir -p /etc/systemd/system/edge-agent.service.d && "
         f"cat > /etc/systemd/system/edge-agent.service.d/test.conf <<'EOF'\n{text}EOF\n"
         "systemctl daemon-reload")


def _events(journal: str) -> list[dict]:
    """The agent's JSON-line events in `journalctl -o cat` output (systemd's own lines skipped). Its own copy:
    scripts/test.sh imports this module as `tests.e2e.test_service_nspawn` (ensure_rootfs), where the tests' helper
    modules (agentproc) are not importable."""
    out = []
    for line in journal.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def test_service_under_real_systemd() -> None:
    rootfs, wheels = prepared()
    step("booting the container (systemd-nspawn -b, systemd as PID 1)")
    c = Container(rootfs, {ROOT: "/src", wheels: "/wheels"}, "edge-test-service")
    try:
        step(f"container up: {c.sh('systemctl --version | head -1').stdout.strip()}")
        before = listing(c)

        install(c, AGENT_YAML, ["WatchdogSec=6"])

        step("start: the unit is `activating` through the self-test, `active` only after READY=1")
        c.sh("systemctl start --no-block edge-agent")
        states = []
        end = time.monotonic() + 120
        while time.monotonic() < end and (not states or states[-1] != "active"):
            states.append(c.sh("systemctl is-active edge-agent", check=False).stdout.strip())
            time.sleep(0.05)
        assert "activating" in states and states[-1] == "active", states
        status = c.prop("StatusText")
        assert status.startswith("serving digits-classifier v1 ") and "CPUExecutionProvider" in status, status
        # READY=1 only after the proof: the self-test report was written before the unit became active
        report_mtime = float(c.sh("stat -c %Y /var/lib/edge-agent/selftest/report.json").stdout)
        active_at = float(c.sh("date -d \"$(systemctl show -p ActiveEnterTimestamp --value edge-agent)\" +%s").stdout)
        assert report_mtime <= active_at + 1, (report_mtime, active_at)
        user = c.sh("ps -o user= -C edge-agent || ps -o user= -p $(systemctl show -p MainPID --value edge-agent)").stdout.strip()
        assert user and user != "root", f"runs as {user!r}"
        step(f"active as dynamic user {user!r}; STATUS={status!r}")

        c.wait_for(lambda: '"state": "online"' in c.sh(
            "mosquitto_sub -h 127.0.0.1 -C 1 -W 3 -t edge/nspawn-dev/availability", check=False).stdout,
            60, "availability online")
        boots = lambda: int(c.sh("cat /var/lib/edge-agent/boots").stdout)  # noqa: E731
        first_boot = boots()

        step("systemctl reload: RELOADING=1, the config is re-read, READY again")
        c.sh("sed -i 's/max_fps: 20/max_fps: 10/' /etc/edge-agent/agent.yaml")
        pid = c.prop("MainPID")
        starts = lambda: c.sh("journalctl -u edge-agent --no-pager -o cat").stdout.count("pipeline.start")  # noqa: E731
        before_reload = starts()
        c.sh("systemctl reload edge-agent")
        c.wait_for(lambda: starts() > before_reload, 60, "a pipeline started on the reloaded config")
        journal = c.sh("journalctl -u edge-agent --no-pager -o cat").stdout
        assert "reload.start" in journal and '"config": "/etc/edge-agent/agent.yaml"' in journal
        # the pipeline starts before READY=1 ends the reload: `reloading` until then, not a failure
        c.wait_for(lambda: c.sh("systemctl is-active edge-agent", check=False).stdout.strip() == "active", 60,
                   "active again after the reload")
        assert c.prop("MainPID") == pid and boots() == first_boot  # same process, reloaded in place
        assert c.prop("StatusText").startswith("serving digits-classifier v1 ")

        step("systemctl stop: `stopped` published (retained)")
        c.sh("systemctl stop edge-agent")
        avail = c.sh("mosquitto_sub -h 127.0.0.1 -C 1 -W 5 -t edge/nspawn-dev/availability").stdout
        assert json.loads(avail)["state"] == "stopped", avail

        step("a crash (SIGKILL) is restarted by Restart=on-failure; the state directory survives")
        c.sh("systemctl start edge-agent")
        restarts = int(c.prop("NRestarts"))
        # systemd 252 once answered "Failed to send signal SIGKILL to auxiliary processes: Input/output
        # error" with the main process killed all the same: the restart below is what this step judges
        c.sh("systemctl kill -s SIGKILL edge-agent", check=False)
        c.wait_for(lambda: int(c.prop("NRestarts")) > restarts and
                   c.sh("systemctl is-active edge-agent", check=False).stdout.strip() == "active", 120, "restart")
        assert boots() >= first_boot + 2
        assert c.sh("test -f /var/lib/edge-agent/selftest/cache.json && echo yes").stdout.strip() == "yes"

        step("a hung pipeline (a camera that never answers) misses the watchdog and is restarted")
        c.sh("systemd-run --unit hung-camera python3 -c \"import socket,time; s=socket.socket(); "
             "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', 8554)); s.listen(8); "
             "conns=[s.accept() for _ in range(8)]; time.sleep(3600)\"")
        # systemd-run returns once the process is forked, not once it listens: a refused connection is a
        # lost stream the agent retries (and keeps pinging), not the hang this step needs
        c.wait_for(lambda: c.sh("python3 -c \"import socket; socket.create_connection(('127.0.0.1', 8554), 2)\"",
                                check=False).returncode == 0, 60, "the hung camera listening")
        c.sh(f"cat >> /etc/edge-agent/agent.yaml <<'EOF'\n{HUNG_CAMERA}\nEOF")
        c.sh("python3 - <<'EOF'\nimport re\np='/etc/edge-agent/agent.yaml'\ns=open(p).read()\n"
             "s=re.sub(r'^source: \\{type: folder.*\\n', '', s, flags=re.M)\nopen(p,'w').write(s)\nEOF")
        c.sh("systemctl restart edge-agent")  # returns once the new process is ready (Type=notify)
        # read after the restart: a manual restart sets NRestarts back to 0, so a count read before it (1,
        # from the SIGKILL above) made this wait for a second watchdog restart (12 s more)
        restarts = int(c.prop("NRestarts"))
        c.wait_for(lambda: int(c.prop("NRestarts")) > restarts, 120, "a watchdog restart")
        journal = c.sh("journalctl -u edge-agent --no-pager").stdout
        assert "Watchdog timeout" in journal, journal[-2000:]  # systemd's own line, not ours
        assert "watchdog.withheld" in journal
        step("watchdog fired: " + next(l for l in journal.splitlines() if "atchdog timeout" in l).strip()[-100:])

        step("scripts/uninstall.sh --purge leaves no stray files")
        c.sh("systemctl stop hung-camera", check=False)
        c.sh("/src/scripts/uninstall.sh --purge")
        after = listing(c)
        stray = sorted(after - before)
        assert not stray, f"left behind: {stray[:30]}"
        step("uninstalled cleanly")
    finally:
        c.stop()
    assert not container_init(c.proc.pid), "the container outlived the test"


def test_a_crash_only_in_the_serving_process_restarts_once_and_serves_the_other_variant() -> None:
    """Issue 19: a variant that crashes only while serving crash-looped the unit (ready, SIGSEGV, restart,
    the same candidate, forever). Under systemd's own Restart=on-failure, with the default config (the
    verdict cache on): the variant that won the proof dies (SIGSEGV) before its 3rd inference in the
    serving process, never in the self-test child; one restart, then the other variant serves, and the
    unit is not restarted again."""
    rootfs, wheels = prepared()
    step("booting the container (systemd-nspawn -b, systemd as PID 1)")
    c = Container(rootfs, {ROOT: "/src", wheels: "/wheels"}, "edge-test-crash")
    try:
        install(c, AGENT_YAML, [])
        active = lambda: c.sh("systemctl is-active edge-agent", check=False).stdout.strip() == "active"  # noqa: E731
        journal = lambda: c.sh("journalctl -u edge-agent --no-pager -o cat").stdout  # noqa: E731
        # which variant wins here (the fp32 is the bundle's preference, the int8 wins when 10 % faster):
        # the fault goes on that one, and the cached verdict serves it again at the next start
        c.sh("systemctl start edge-agent")
        status = c.prop("StatusText")
        assert status.startswith("serving digits-classifier v1 "), status
        won = status.split()[3]
        other = {"int8": "fp32", "fp32": "int8"}[won]
        c.sh("systemctl stop edge-agent")
        fault = f"serve:CPUExecutionProvider:{won}#3=SIGSEGV"
        dropin(c, [f"Environment=EDGE_AGENT_FAULT={fault}"])
        before = int(c.prop("NRestarts"))
        step(f"{won} won the proof; start with EDGE_AGENT_FAULT={fault}: it dies serving")
        c.sh("systemctl start --no-block edge-agent")
        c.wait_for(lambda: int(c.prop("NRestarts")) > before and active()
                   and c.prop("StatusText").startswith(f"serving digits-classifier v1 {other} "), 300,
                   f"a restart that serves the {other}")
        pid = c.prop("MainPID")
        status = c.prop("StatusText")
        # barrier: the restarted process served past the inferences its marker covers (the first died at
        # its 3rd), so a crash loop would have shown by now; then count systemd's restarts
        watched = lambda: any(e.get("event") == "serving.watch_done"  # noqa: E731
                              and e.get("candidate") == f"CPUExecutionProvider:{other}" for e in _events(journal()))
        c.wait_for(watched, 120, f"the {other} serving past its first inferences")
        restarts = int(c.prop("NRestarts")) - before
        assert restarts == 1, f"{restarts} restarts: a crash loop\n{journal()[-3000:]}"
        assert c.prop("MainPID") == pid and active()
        assert int(c.sh("cat /var/lib/edge-agent/boots").stdout) == 3  # the clean run, the crash, the restart
        text = journal()
        assert "status=11/SEGV" in text, text[-3000:]  # systemd's own line: the process died of it
        recorded = [e for e in _events(text) if e.get("event") == "serving.crash_recorded"]
        assert [e["candidate"] for e in recorded] == [f"CPUExecutionProvider:{won}"], recorded
        crashes = json.loads(c.sh("cat /var/lib/edge-agent/selftest/crashes.json").stdout)
        assert [(r["step"], r["signal"]) for r in crashes] == [
            (f"candidate:CPUExecutionProvider:{won}", "the serving process died")], crashes
        step(f"one restart (NRestarts {before} -> {before + restarts}); {status!r}")
    finally:
        c.stop()
    assert not container_init(c.proc.pid), "the container outlived the test"
