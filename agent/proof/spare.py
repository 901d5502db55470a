"""A self-test child started before the boot proof needs it, so its imports overlap the agent's own.

A cold `edge-agent run` imported the agent (about 0.5 s of CPU) and only then spawned the proof child,
which imported onnxruntime, numpy, OpenCV and the proof (about 0.45 s more) while the agent waited: two
cores, one busy. The spare is spawned first thing, imports on the other core, and waits for its
arguments on stdin; the boot proof adopts it instead of spawning (`isolation.prove_in_child`). It is
the same process the proof would have spawned (same interpreter, module, wrapper, session and death
signal), so a crash in it is recorded exactly as before. Unadopted, it is discarded after the boot
proof, and it exits by itself on EOF (the agent exited) or after `IDLE_S`.

This module imports nothing heavy: it runs before the agent's own imports.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any, Mapping, Sequence

CHILD_MODULE = "agent.service.selftest_child"
SPARE_FLAG = "--spare-for"  # the child's argv: --spare-for <what it waits for> (named in ps, and by tests)
IDLE_S = 120.0              # a spare nobody adopted exits by itself after this long
ADOPT_WITHIN_S = IDLE_S / 2  # older ones are not adopted: the hand-over never races the spare's own exit
# What may change in the agent's environment between the spare's spawn and its adoption: read by the child
# after its arguments arrive (OpenCV's FFmpeg log level at first use, the agent's own variables), so the
# spare takes the new values. Any other change (a variable a library reads at import) refuses the spare.
LATE_READ = ("OPENCV_", "EDGE_AGENT_")
# Set by the agent's own imports, and by the spare's the same way: OpenCV's loader adds its wheel's library
# folder to LD_LIBRARY_PATH in os.environ on import (the spare then runs as the agent itself started).
SET_BY_IMPORTS = ("LD_LIBRARY_PATH",)

_lock = threading.Lock()
_spare: "Spare | None" = None  # one per process, taken at most once


def die_with_parent() -> None:
    """In the forked child before exec: SIGKILL when the parent dies, so a killed agent leaves no
    self-test running on (a leftover marker makes the next boot skip that step, as a crash would)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the child finishes on its own


def child_prefix() -> list[str]:
    """The command line before the child's own arguments, as `prove_in_child` builds it."""
    wrapper = os.environ.get("EDGE_AGENT_SELFTEST_WRAPPER")  # e.g. "nice -n 10" or "systemd-run --scope ..."
    return (wrapper.split() if wrapper else []) + [sys.executable, "-m", CHILD_MODULE]


class Spare:
    def __init__(self, proc: subprocess.Popen, prefix: Sequence[str], env: Mapping[str, str]):
        self.proc, self.prefix, self.env = proc, list(prefix), dict(env)
        self.started = time.monotonic()

    def env_change(self, now: Mapping[str, str]) -> dict[str, Any] | None:
        """The environment the child must take on ({"set": ..., "unset": ...}), or None when a change
        could have mattered during its imports."""
        changed = {k: v for k, v in now.items() if self.env.get(k) != v}
        gone = [k for k in self.env if k not in now]
        if any(not k.startswith(LATE_READ) and k not in SET_BY_IMPORTS for k in [*changed, *gone]):
            return None
        return {"set": changed, "unset": gone}

    def discard(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stderr):
            if stream is not None:
                stream.close()


def start(what: str) -> None:
    """Spawn this process's spare proof child (`what`: the config it will prove for, shown in its argv)."""
    global _spare
    with _lock:
        if _spare is not None:
            return
        env = dict(os.environ)
        prefix = child_prefix()
        try:
            proc = subprocess.Popen([*prefix, SPARE_FLAG, what], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
                                    preexec_fn=die_with_parent)
        except OSError:
            return  # the proof spawns its own child as before
        _spare = Spare(proc, prefix, env)


def adopt(cmd: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen | None:
    """The spare, handed `cmd`'s arguments, when it is the process `cmd` would start in `env`; else None
    (and the spare is discarded). Taken at most once."""
    global _spare
    with _lock:
        spare, _spare = _spare, None
    if spare is None:
        return None
    change = spare.env_change(env)
    stale = time.monotonic() - spare.started > ADOPT_WITHIN_S
    if list(cmd[:len(spare.prefix)]) != spare.prefix or change is None or stale or spare.proc.poll() is not None:
        spare.discard()
        return None
    stdin: IO[str] | None = spare.proc.stdin
    try:
        assert stdin is not None
        stdin.write(json.dumps({"argv": list(cmd[len(spare.prefix):]), "env": change}) + "\n")
        stdin.close()
    except (OSError, ValueError):  # it died since: the proof spawns its own child
        spare.discard()
        return None
    return spare.proc


def discard() -> None:
    """The boot proof is over (or never ran): an unadopted spare would only hold memory."""
    global _spare
    with _lock:
        spare, _spare = _spare, None
    if spare is not None:
        spare.discard()


def wait_for_arguments(stream: IO[str]) -> list[str] | None:
    """In the spare: its arguments (the environment changes applied), or None when the agent exited or
    never adopted it within IDLE_S."""
    done = threading.Event()
    threading.Thread(target=lambda: done.wait(IDLE_S) or os._exit(0), daemon=True, name="spare-idle").start()
    line = stream.readline()
    done.set()
    if not line:
        return None
    doc = json.loads(line)
    for k in doc["env"]["unset"]:
        os.environ.pop(k, None)
    os.environ.update(doc["env"]["set"])
    return [str(a) for a in doc["argv"]]
