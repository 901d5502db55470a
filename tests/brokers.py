"""Real Mosquitto brokers for tests, started by the tests on 127.0.0.1 with their own config files.

`max_queued_messages 0`: the default 1000 silently drops QoS 1 messages for a slow subscriber.
Persistence with a 1 s autosave keeps persistent subscribers' sessions across a broker SIGKILL.

The fleet's end-to-end tests also run on a second implementation, aedes (Node.js, MQTT 3.1.1 only:
tests/aedes/, installed by scripts/test.sh into $EDGE_AGENT_CACHE/aedes), alone and as a two-node
cluster sharing retained state through Redis (Debian's redis-server): `fleet_broker(kind, workdir)`.
Every broker here has `port` (where the operator connects), `device_port` (where devices connect: the
other node of a cluster) and `protocol` (what MQTT version its clients speak).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import paho.mqtt.client as paho

from waiting import end_process, wait_until

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"mosquitto did not listen on {port}")


@dataclass
class Broker:
    workdir: Path
    port: int = field(default_factory=free_port)
    protocol: str = "5"
    autosave_s: int = 1  # longer: a SIGKILL loses what arrived since the last save (the field's broker crash)
    tls_port: int | None = None
    tls: dict | None = None  # {"ca", "cert", "key", "passwd", "acl"}
    proc: subprocess.Popen | None = None
    starts: int = 0

    def write_config(self) -> Path:
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        lines = [
            # as root, mosquitto drops to user "mosquitto", which cannot write into the test's private dirs
            *(["user root"] if os.geteuid() == 0 else []),
            "per_listener_settings true",
            "persistence true",
            f"persistence_location {data}/",
            f"autosave_interval {self.autosave_s}",
            "max_queued_messages 0",
            "max_inflight_messages 0",
            "log_dest stderr",
            "log_type error",
            "log_type warning",
            f"listener {self.port} 127.0.0.1",
            "allow_anonymous true",
        ]
        if self.tls:
            lines += [
                f"listener {self.tls_port} 127.0.0.1",
                f"cafile {self.tls['ca']}",
                f"certfile {self.tls['cert']}",
                f"keyfile {self.tls['key']}",
                "allow_anonymous false",
                f"password_file {self.tls['passwd']}",
                f"acl_file {self.tls['acl']}",
            ]
        conf = self.workdir / "mosquitto.conf"
        conf.write_text("\n".join(lines) + "\n")
        return conf

    def start(self) -> "Broker":
        for attempt in range(3):
            conf = self.write_config()
            log_path = self.workdir / f"mosquitto-{self.starts}.log"
            self.proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=open(log_path, "w"),
                                         stderr=subprocess.STDOUT)
            self.starts += 1
            try:
                wait_port(self.port, 30)
                if self.tls_port:
                    wait_port(self.tls_port, 30)
            except TimeoutError:
                if self.proc.poll() is None:
                    raise
            # Something else answering on the port is not our broker: free_port() only picked a port that
            # was free a moment before mosquitto bound it. On a first start, take other ports and retry.
            time.sleep(0.2)
            if self.proc.poll() is None:
                return self
            if self.starts - attempt > 1 or attempt == 2:  # a restart must keep its port: say why it failed
                raise RuntimeError(f"mosquitto exited ({self.proc.returncode}): {log_path.read_text()[-1000:]}")
            self.port = free_port()
            if self.tls_port:
                self.tls_port = free_port()
        return self

    def kill(self) -> None:
        end_process(self.proc, graceful=False)

    def wait_saved(self, after: float, timeout: float = 30.0) -> bool:
        """Wait until the broker has autosaved its state (sessions, subscriptions) at or after wall time
        `after`, so that a SIGKILL from then on keeps what it held at `after`."""
        db = self.workdir / "data" / "mosquitto.db"
        return wait_until(lambda: db.exists() and db.stat().st_mtime > after, timeout)

    def stop(self) -> None:
        end_process(self.proc, timeout=10)

    @property
    def device_port(self) -> int:
        return self.port

    @property
    def agent_mqtt(self) -> dict:
        """What an agent's `mqtt` config needs on this broker (nothing: MQTT 5)."""
        return {}


CACHE = Path(os.environ.get("EDGE_AGENT_CACHE") or Path.home() / ".cache" / "edge-agent")
AEDES_MODULES = CACHE / "aedes" / "node_modules"
AEDES_SCRIPT = Path(__file__).resolve().parent / "aedes" / "broker.mjs"
REDIS = shutil.which("redis-server") or "/usr/bin/redis-server"


def aedes_missing() -> str | None:
    """Why aedes cannot run here, or None: scripts/test.sh installs it (npm ci) and Redis (apt)."""
    if not shutil.which("node"):
        return "node is not installed (scripts/test.sh installs nodejs and npm)"
    if not (AEDES_MODULES / "aedes" / "package.json").exists():
        return f"aedes is not installed in {AEDES_MODULES} (scripts/test.sh runs npm ci there; see its log)"
    return None


def _start(argv: list[str], log: Path, port: int, what: str) -> subprocess.Popen:
    proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        wait_port(port, 30)
    except TimeoutError:
        end_process(proc, graceful=False)
        raise RuntimeError(f"{what} did not listen on {port}: {log.read_text()[-1000:]}") from None
    if proc.poll() is not None:
        raise RuntimeError(f"{what} exited ({proc.returncode}): {log.read_text()[-1000:]}")
    return proc


@dataclass
class AedesBroker:
    """One aedes node: in memory alone, or on a Redis (persistence and emitter) shared with other nodes."""

    workdir: Path
    port: int = field(default_factory=free_port)
    redis_port: int | None = None
    protocol: str = "3.1.1"
    proc: subprocess.Popen | None = None

    def start(self) -> "AedesBroker":
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = ["node", str(AEDES_SCRIPT), str(AEDES_MODULES), str(self.port)]
        if self.redis_port:
            argv.append(str(self.redis_port))
        self.proc = _start(argv, self.workdir / f"aedes-{self.port}.log", self.port, "aedes")
        return self

    @property
    def device_port(self) -> int:
        return self.port

    @property
    def agent_mqtt(self) -> dict:
        return {"protocol": "3.1.1"}

    def kill(self) -> None:
        end_process(self.proc, graceful=False)

    def stop(self) -> None:
        end_process(self.proc, timeout=10)


@dataclass
class AedesCluster:
    """Two aedes nodes on one Redis (no disk persistence: the tests start it fresh). The operator talks to
    node A, the devices to node B: every command and every retained document crosses the cluster."""

    workdir: Path
    protocol: str = "3.1.1"
    redis_port: int = field(default_factory=free_port)
    redis: subprocess.Popen | None = None
    nodes: list[AedesBroker] = field(default_factory=list)

    def start(self) -> "AedesCluster":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.redis = _start([REDIS, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(self.workdir)],
                            self.workdir / "redis.log", self.redis_port, "redis-server")
        self.nodes = [AedesBroker(self.workdir / n, redis_port=self.redis_port).start() for n in "ab"]
        return self

    @property
    def port(self) -> int:
        return self.nodes[0].port

    @property
    def device_port(self) -> int:
        return self.nodes[1].port

    @property
    def agent_mqtt(self) -> dict:
        # clean sessions: aedes 1.2 on aedes-persistence-redis 11.2 never acknowledges a persistent session's
        # SUBSCRIBE naming two or more topics, and the agent subscribes to its commands and bundle transfers
        # in one (the operator subscribes topic by topic: agent/fleet/state.py)
        return {"protocol": "3.1.1", "clean_start": True}

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
        end_process(self.redis, timeout=10)


FLEET_BROKERS = ("mosquitto", "aedes", "aedes-cluster")


def fleet_broker(kind: str, workdir: Path) -> "Broker | AedesBroker | AedesCluster":
    """A started broker of `kind` (FLEET_BROKERS); pytest.skip, with the reason, where it is not installed."""
    import pytest

    if kind == "mosquitto":
        return Broker(workdir).start()
    missing = aedes_missing()
    if missing is None and kind == "aedes-cluster" and not Path(REDIS).exists():
        missing = "redis-server is not installed (scripts/test.sh installs it with apt)"
    if missing:
        pytest.skip(f"{kind}: {missing}")
    return AedesBroker(workdir).start() if kind == "aedes" else AedesCluster(workdir).start()


def make_tls_material(d: Path) -> dict:
    """A CA, a server certificate for 127.0.0.1, a password file and an ACL, made with openssl and
    mosquitto_passwd."""
    d.mkdir(parents=True, exist_ok=True)

    def run(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, cwd=d)

    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=edge-test-ca",
        "-keyout", "ca.key", "-out", "ca.crt")
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key",
        "-out", "server.csr")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "2", "-extfile", "san.ext", "-out", "server.crt")
    passwd = d / "passwd"
    run("mosquitto_passwd", "-b", "-c", str(passwd), "agent", "agent-secret")
    run("mosquitto_passwd", "-b", str(passwd), "operator", "operator-secret")
    run("mosquitto_passwd", "-b", str(passwd), "viewer", "viewer-secret")
    acl = d / "acl"
    acl.write_text(
        "user agent\ntopic readwrite edge/#\n\n"
        "user operator\ntopic readwrite edge/#\n\n"
        "user viewer\ntopic read edge/#\n"
    )
    return {"ca": d / "ca.crt", "cert": d / "server.crt", "key": d / "server.key", "passwd": passwd, "acl": acl}


class Collector:
    """A real subscriber; persistent (clean_start false, session expiry) when given a client id.

    `connects` counts connections whose subscriptions the broker has acknowledged (SUBACK), so a test
    that waits for it and then makes something publish cannot publish before the subscription exists.
    """

    def __init__(self, port: int, topics: list[str], client_id: str = "", persistent: bool = False,
                 tls: dict | None = None, username: str | None = None, password: str | None = None,
                 tls_port: int | None = None, protocol: str = "5"):
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        self.messages: list[paho.MQTTMessage] = []
        self.topics = topics
        self.connects = 0
        v5 = protocol == "5"
        self.c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id,
                             protocol=paho.MQTTv5 if v5 else paho.MQTTv311, clean_session=None if v5 else not persistent)
        if tls:
            self.c.tls_set(ca_certs=str(tls["ca"]))
        if username:
            self.c.username_pw_set(username, password)
        self.c.on_message = lambda c, u, m: self.messages.append(m)
        self.c.on_connect = self._on_connect
        self.c.on_subscribe = self._on_subscribe
        self.c.reconnect_delay_set(0.1, 0.5)
        props = None
        if persistent and v5:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = 3600
        self.last_reason = None
        if v5:
            self.c.connect_async("127.0.0.1", tls_port or port, 10, clean_start=not persistent, properties=props)
        else:
            self.c.connect_async("127.0.0.1", tls_port or port, 10)
        self.c.loop_start()

    def _on_connect(self, c, u, flags, reason, props) -> None:
        self.last_reason = reason
        if reason.is_failure:
            return
        if not self.topics:
            self.connects += 1
            return
        c.subscribe([(t, 1) for t in self.topics])  # one SUBACK for all of them

    def _on_subscribe(self, c, u, mid, reason_codes, props) -> None:
        self.connects += 1

    def on(self, topic: str) -> list[paho.MQTTMessage]:
        return [m for m in list(self.messages) if m.topic == topic]

    def wait(self, pred, timeout: float = 20.0) -> bool:
        return wait_until(pred, timeout)

    def close(self) -> None:
        # disconnect first: loop_stop() alone waits out paho's 1 s select before the thread sees the stop
        self.c.disconnect()
        self.c.loop_stop()


def demo_mqtt_config(device_id: str, state_dir: Path, port: int, *, stdout: bool = False, max_fps: float = 40,
                     **mqtt: object) -> dict:
    """The demo config with MQTT on `port` (agentproc.demo_config, the one definition), for tests that
    build their own process; new tests take `demo_config` and the `agent_process` fixture."""
    from agentproc import demo_config

    return demo_config(Path(state_dir).parent, port=port, device_id=device_id, state_dir=str(state_dir),
                       source={"max_fps": max_fps}, output={"stdout": stdout}, mqtt=mqtt)
