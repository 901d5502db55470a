"""One real `edge-agent run` process for a test: config, events, results, and a clean end.

Every test that starts an agent process uses this instead of a private `_config/_start/_events`:
stderr and stdout go to files (a pipe nobody reads fills at 64 KB and blocks the agent's logging),
events are read back as JSON lines, and waiting is a bounded poll on what the agent wrote.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import yaml

ROOT = Path(__file__).resolve().parents[1]
DEMO_BUNDLE = ROOT / "models" / "digits-classifier"
DEMO_FRAMES = ROOT / "models" / "demo-frames" / "digits"


def demo_config(tmp: Path, *, port: int | None = None, device_id: str = "dev-test", loop: bool = True,
                **overrides: Any) -> dict[str, Any]:
    """The demo bundle on the demo frames, looping at 200 fps (`loop=False`: each frame once, unpaced),
    health every 0.5 s; MQTT on `port`. A mapping override is merged into the default's mapping; `sources`
    replaces `source`."""
    source: dict[str, Any] = {"type": "folder", "path": str(DEMO_FRAMES)}
    if loop:
        source.update(loop=True, max_fps=200)
    cfg: dict[str, Any] = {
        "device_id": device_id,
        "state_dir": str(tmp / "state"),
        "bundle": str(DEMO_BUNDLE),
        "source": source,
        "output": {"health_interval_s": 0.5},
    }
    if port is not None:
        cfg["mqtt"] = {"enabled": True, "port": port, "keepalive": 5, "reconnect_min_s": 1, "reconnect_max_s": 1}
    if "sources" in overrides:
        del cfg["source"]  # many named sources instead of the one
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(cfg.get(key), Mapping):
            cfg[key] = {**cfg[key], **value}  # e.g. source={"loop": False} keeps the demo folder
        else:
            cfg[key] = value
    return cfg


def int8_first(tmp: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` serving a copy of the demo bundle that prefers int8 (and, with `prefer_margin: 1`, keeps the
    preferred variant whenever it passes): int8 is served, and fp32 when int8 fails or crashes.

    Tests of crash and fallback paths need a known winner; the demo's own order (fp32 unless int8 is 10 %
    faster) depends on the CPU: on AVX2 without VNNI its 7-bit INT8 is no faster, and fp32 wins."""
    import shutil

    from agent.testing import rewrite_manifest

    bundle = tmp / "digits-int8-first"
    if not bundle.exists():
        shutil.copytree(DEMO_BUNDLE, bundle)
        rewrite_manifest(bundle, lambda m: m["preference"].update(CPUExecutionProvider=["int8", "fp32"]))
    return {**cfg, "bundle": str(bundle), "selection": {**cfg.get("selection", {}), "prefer_margin": 1.0}}


def parse_events(text: str) -> list[dict[str, Any]]:
    """JSON-line events of a log (a line being written, or a non-JSON line, is skipped)."""
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def boot_to_end(factory: Callable[..., "AgentProcess"], config: Mapping[str, Any], fault: str | None = None,
                timeout: float = 180) -> "AgentProcess":
    """One boot from `factory` (the agent_process fixture) run to its end under EDGE_AGENT_FAULT=`fault`:
    the process, ended, with its own log (its exit code in `returncode`)."""
    agent = factory(config, env={"EDGE_AGENT_FAULT": fault or ""})
    agent.run(timeout)
    return agent


class AgentProcess:
    """`python -m agent --log-json run --config <tmp>/<name>.yaml`, stdout and stderr in files under `tmp`.

    `env` is added to this process's environment (a None value takes a variable out)."""

    def __init__(self, tmp: Path, config: Mapping[str, Any] | None = None, *,
                 env: Mapping[str, str | None] | None = None,
                 args: Iterable[str] = (), name: str = "agent", log_args: Iterable[str] = ("--log-json",),
                 preexec: Callable[[], None] | None = None):
        self.tmp = Path(tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.config = dict(config if config is not None else demo_config(self.tmp))
        self.config_path = self.tmp / f"{name}.yaml"
        self.log_path = self.tmp / f"{name}.log"
        self.out_path = self.tmp / f"{name}.out"
        self.env = dict(env or {})
        self.args = list(args)
        self.log_args = list(log_args)  # global options before `run`, e.g. ("--log-level", "warning")
        self.preexec = preexec  # run in the child before exec (a resource limit)
        self.proc: subprocess.Popen[str] | None = None
        self.starts = 0

    @property
    def state_dir(self) -> Path:
        return Path(self.config["state_dir"])

    def write_config(self) -> Path:
        self.config_path.write_text(yaml.safe_dump(self.config))
        return self.config_path

    def start(self) -> "AgentProcess":
        """Start (or restart after it ended); logs of every start are kept, appended in order."""
        assert self.proc is None or self.proc.poll() is not None, "the agent is still running"
        self.write_config()
        cmd = [sys.executable, "-m", "agent", *self.log_args, "run", "--config", str(self.config_path), *self.args]
        env = {k: v for k, v in {**os.environ, **self.env}.items() if v is not None}  # None: taken out
        with self.log_path.open("a") as err, self.out_path.open("a") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, text=True, env=env,
                                         preexec_fn=self.preexec)
        self.starts += 1
        return self

    # -- what it wrote ---------------------------------------------------------------------------------
    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        evs = parse_events(self.log_text())
        return evs if name is None else [e for e in evs if e.get("event") == name]

    def out_text(self) -> str:
        return self.out_path.read_text() if self.out_path.exists() else ""

    def results(self) -> list[dict[str, Any]]:
        return parse_events(self.out_text())

    def positions(self, name: str) -> list[int]:
        """Where events called `name` stand in the sequence of all events (to check what came first)."""
        return [i for i, e in enumerate(self.events()) if e.get("event") == name]

    # -- waiting ---------------------------------------------------------------------------------------
    def wait_event(self, name: str, pred: Callable[[dict[str, Any]], bool] | None = None,
                   timeout: float = 60.0, count: int = 1) -> dict[str, Any]:
        """The `count`-th event called `name` (matching `pred`); fails naming what was seen instead."""
        found: list[dict[str, Any]] = []

        def seen() -> bool:
            found[:] = [e for e in self.events(name) if pred is None or pred(e)]
            return len(found) >= count

        if not self._poll(seen, timeout):
            names = [e.get("event") for e in self.events()][-15:]
            raise AssertionError(f"{self.name}: no {count} x {name!r} within {timeout:g} s (exit "
                                 f"{self.returncode}); last events: {names}\n{self.log_text()[-3000:]}")
        return found[count - 1]

    def wait(self, pred: Callable[[], object], timeout: float = 60.0, what: str = "the condition") -> None:
        """A barrier on anything the test can see; fails with the agent's log tail."""
        if not self._poll(lambda: bool(pred()), timeout):
            raise AssertionError(f"{self.name}: {what} did not hold within {timeout:g} s (exit "
                                 f"{self.returncode})\n{self.log_text()[-3000:]}")

    def wait_results(self, n: int, timeout: float = 60.0) -> list[dict[str, Any]]:
        if not self._poll(lambda: len(self.results()) >= n, timeout):
            raise AssertionError(f"{self.name}: {len(self.results())} of {n} results within {timeout:g} s (exit "
                                 f"{self.returncode})\n{self.log_text()[-3000:]}")
        return self.results()

    def wait_exit(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name}: still running after {timeout:g} s\n{self.log_text()[-3000:]}")

    def run(self, timeout: float = 120.0) -> int:
        """Start and wait for the end (a run with `--max-frames`, or one that must fail): the exit code."""
        self.start()
        try:
            return self.wait_exit(timeout)
        except AssertionError:
            self.kill()
            raise

    def _poll(self, pred: Callable[[], bool], timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if pred():
                return True
            if self.proc is not None and self.proc.poll() is not None:
                return pred()  # it ended: what it wrote is all there will be
            time.sleep(0.05)
        return pred()

    # -- ending ----------------------------------------------------------------------------------------
    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM and wait (SIGKILL if it hangs past `timeout`); the exit code, None if never started."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "AgentProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
