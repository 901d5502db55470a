"""Hostile inputs against a running agent and a real broker: every one costs a bounded amount and gets a
clear answer. One agent (demo bundle, updates on) serves the whole module; each test is a fault from
issue 12 that the old code had: memory blown by an offer, replies sent where the caller said, transfers
that never expired, deep JSON with no reply, URLs that crashed the handler or left staging behind."""

from __future__ import annotations

import http.server
import json
import os
import resource
import threading
import time
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agentproc import AgentProcess, demo_config
from brokers import MOSQUITTO, Broker, Collector
from waiting import wait_until

DEVICE, OTHER = "dev-h", "dev-other"
PREFIX = f"edge/{DEVICE}/"
IDLE_S = 3.0
PEAK_RSS_BOUND_MB = 300

pytestmark = pytest.mark.skipif(not Path(MOSQUITTO).exists() and not os.environ.get("CI"),
                                reason="mosquitto is not installed (scripts/test.sh installs it)")


def vm_hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def _limit_memory() -> None:
    # the old code needed 17 GB for one offer: cap the address space so a regression fails, not the machine
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("hostile")
    broker = Broker(tmp / "broker").start()
    cfg = demo_config(tmp, port=broker.port, device_id=DEVICE, source={"max_fps": 30}, output={"stdout": False},
                      updates={"enabled": True, "max_bundle_bytes": 512 * 2**20, "transfer_idle_s": IDLE_S,
                               "download_timeout_s": 1.0, "download_deadline_s": 3.0, "min_free_bytes": 0})
    proc = AgentProcess(tmp, cfg, preexec=_limit_memory).start()  # one agent for the module
    col = Collector(broker.port, [PREFIX + "#", f"edge/{OTHER}/#"])
    try:
        assert col.wait(lambda: len(col.on(PREFIX + "predictions")) >= 3, 90), proc.log_text()[-3000:]
        yield {"proc": proc, "col": col, "broker": broker, "tmp": tmp, "staging": tmp / "state" / "store" / "staging"}
    finally:
        proc.stop()
        col.close()
        broker.stop()


class Client:
    def __init__(self, port: int):
        self.c = paho.Client(paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
        self.replies: list[paho.MQTTMessage] = []
        self.c.on_message = lambda c, u, m: self.replies.append(m)
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()

    def pub(self, topic: str, payload: bytes | str, props: Properties | None = None) -> None:
        self.c.publish(topic, payload, qos=1, properties=props).wait_for_publish(30)

    def close(self) -> None:
        self.c.disconnect()  # first: loop_stop() alone waits out paho's 1 s select
        self.c.loop_stop()


@pytest.fixture
def client(agent: dict):
    c = Client(agent["broker"].port)
    yield c
    c.close()


def statuses(col: Collector, tid: str) -> list[dict]:
    return [d for d in (json.loads(m.payload) for m in col.on(PREFIX + "update/status")) if d["update"] == tid]


def replies(col: Collector, name: str) -> list[dict]:
    return [json.loads(m.payload) for m in col.on(PREFIX + f"cmd/{name}/reply")]


def handled(agent: dict, client: Client, uid: str) -> None:
    """A barrier: a status command sent after what the client sent before it is answered. Messages of one
    client reach the agent in order and the controller handles them in order, so all before it are done."""
    col = agent["col"]
    client.pub(PREFIX + "cmd/status", json.dumps({"id": uid}))
    assert col.wait(lambda: any(r.get("id") == uid for r in replies(col, "status")), 60), f"no reply to {uid}"


def still_serving(agent: dict) -> bool:
    n = len(agent["col"].on(PREFIX + "predictions"))
    return agent["proc"].returncode is None and agent["col"].wait(lambda: len(agent["col"].on(PREFIX + "predictions")) > n + 2, 30)


def test_offer_of_512_mib_in_1_byte_chunks_is_refused_and_memory_stays_bounded(agent: dict, client: Client) -> None:
    col = agent["col"]
    tid = "huge1"
    offer = {"transfer": tid, "size": 512 * 2**20, "sha256": "0" * 64, "chunk_size": 1}
    client.pub(PREFIX + "bundle/offer", json.dumps(offer))
    client.pub(PREFIX + "bundle/done", json.dumps({"transfer": tid}))
    assert col.wait(lambda: any(s["state"] == "rejected" for s in statuses(col, tid)), 30)
    assert "chunk_size 1 is outside" in statuses(col, tid)[0]["reason"]
    # the smallest chunk size allowed: accepted, and `done` answers with a bounded list of what is missing
    tid = "huge2"
    client.pub(PREFIX + "bundle/offer", json.dumps({**offer, "transfer": tid, "chunk_size": 1024}))
    client.pub(PREFIX + "bundle/done", json.dumps({"transfer": tid}))
    assert col.wait(lambda: any(s["step"] == "missing" for s in statuses(col, tid)), 20), statuses(col, tid)
    missing = [s for s in statuses(col, tid) if s["step"] == "missing"][0]
    assert missing["count"] == 512 * 1024 and len(missing["chunks"]) == 1000
    assert still_serving(agent)
    peak = vm_hwm_mb(agent["proc"].pid)
    print(f"peak RSS after hostile offers: {peak:.0f} MB (bound {PEAK_RSS_BOUND_MB} MB)")
    assert peak < PEAK_RSS_BOUND_MB


def test_response_topic_of_another_device_is_refused_and_nothing_is_published_there(agent: dict, client: Client) -> None:
    col = agent["col"]
    for target in (f"edge/{OTHER}/cmd/pause", PREFIX + "predictions"):
        props = Properties(PacketTypes.PUBLISH)
        props.ResponseTopic = target
        props.CorrelationData = b"x"
        n = len(replies(col, "status"))
        client.pub(PREFIX + "cmd/status", b"{}", props)
        assert col.wait(lambda: len(replies(col, "status")) > n, 30)
        body = replies(col, "status")[-1]
        assert body["ok"] is False and "outside this device's reply namespace" in body["error"]
    # Barrier: the agent publishes in order on one connection; once the reply to one more command is
    # here, a reply it had sent to a refused response topic would have arrived first.
    n = len(replies(col, "status"))
    client.pub(PREFIX + "cmd/status", b"{}")
    assert col.wait(lambda: len(replies(col, "status")) > n, 30)
    assert col.on(f"edge/{OTHER}/cmd/pause") == []
    assert all("command" not in json.loads(m.payload) for m in col.on(PREFIX + "predictions"))
    # the device's own reply namespace is honoured
    props = Properties(PacketTypes.PUBLISH)
    props.ResponseTopic = PREFIX + "reply/op-7"
    client.pub(PREFIX + "cmd/status", b'{"id": 3}', props)
    assert col.wait(lambda: col.on(PREFIX + "reply/op-7"), 30)
    assert json.loads(col.on(PREFIX + "reply/op-7")[0].payload)["ok"] is True


@pytest.mark.parametrize("payload", [b"[" * 60_000, b'{"a":' * 10_000 + b"1" + b"}" * 10_000,
                                     b'{"id": 1, "x": "' + b"a" * 200_000 + b'"}'])
def test_deeply_nested_or_huge_command_gets_an_error_reply(agent: dict, client: Client, payload: bytes) -> None:
    col = agent["col"]
    n = len(replies(col, "status"))
    t0 = time.monotonic()
    client.pub(PREFIX + "cmd/status", payload)
    assert col.wait(lambda: len(replies(col, "status")) > n, 30), "no reply"
    print(f"{len(payload)} byte payload answered in {(time.monotonic() - t0) * 1000:.0f} ms: {replies(col, 'status')[-1]['error']}")
    body = replies(col, "status")[-1]
    assert body["ok"] is False and body["error"].startswith("malformed payload")
    assert still_serving(agent)


def staged(agent: dict) -> list[str]:
    return sorted(p.name for p in agent["staging"].iterdir())


def test_abandoned_transfers_expire_and_staging_is_swept(agent: dict, client: Client) -> None:
    col = agent["col"]
    tids = [f"half{i}" for i in range(10)]
    for tid in tids:
        client.pub(PREFIX + "bundle/offer", json.dumps({"transfer": tid, "size": 64 * 1024, "sha256": "0" * 64,
                                                         "chunk_size": 4096}))
        for i in range(4):
            client.pub(PREFIX + f"bundle/chunk/{tid}/{i}", os.urandom(4096))
    assert col.wait(lambda: any(s["step"] == "receiving" for s in statuses(col, tids[-1])), 30)
    # newest wins: every earlier one was ended at once, with a reason
    for tid in tids[:-1]:
        assert any("superseded" in s.get("reason", "") for s in statuses(col, tid)), statuses(col, tid)
    assert len(staged(agent)) <= 1
    t0 = time.monotonic()
    # the sweep removes it some seconds after transfer_idle_s; a loaded machine needs room (never: fails)
    assert wait_until(lambda: staged(agent) == [], IDLE_S + 30), staged(agent)
    print(f"staging empty {time.monotonic() - t0:.1f} s after the last chunk (transfer_idle_s {IDLE_S:g})")
    assert col.wait(lambda: any("expired" in s.get("reason", "") for s in statuses(col, tids[-1])), 30)


def test_same_transfer_offered_twice_leaves_no_orphan(agent: dict, client: Client) -> None:
    col = agent["col"]
    offer = {"transfer": "twice", "size": 8192, "sha256": "0" * 64, "chunk_size": 4096}
    for _ in range(2):
        client.pub(PREFIX + "bundle/offer", json.dumps(offer))
        client.pub(PREFIX + "bundle/chunk/twice/0", os.urandom(4096))
    assert col.wait(lambda: sum(s["step"] == "receiving" for s in statuses(col, "twice")) == 2, 30)
    handled(agent, client, "after-twice")  # both offers and both chunks are handled: not a fixed 0.3 s
    assert len(staged(agent)) == 1
    for _ in range(3):
        client.pub(PREFIX + "bundle/done", json.dumps({"transfer": "twice"}))
    assert col.wait(lambda: any(s["state"] == "rejected" for s in statuses(col, "twice")), 30)
    assert wait_until(lambda: staged(agent) == [], 30)


# -- URL delivery -------------------------------------------------------------------------------------------
class HostileWeb:
    """A real HTTP server: /big streams past the limit, /slow trickles, /ftp redirects to ftp://."""

    def __init__(self) -> None:
        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/ftp":
                    self.send_response(302)
                    self.send_header("Location", "ftp://127.0.0.1/bundle.tar.gz")
                    self.end_headers()
                    return
                self.send_response(200)
                self.end_headers()
                try:
                    if self.path == "/big":  # no Content-Length: only the streaming check can stop it
                        for _ in range(2048):
                            self.wfile.write(b"\0" * (1 << 20))
                    elif self.path == "/slow":
                        for _ in range(200):
                            self.wfile.write(b"\0" * 10)
                            self.wfile.flush()
                            time.sleep(0.5)
                except OSError:
                    pass

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.srv.server_address[1]}"

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture
def web():
    w = HostileWeb()
    yield w
    w.close()


def _update(agent: dict, client: Client, url: str, uid: str) -> dict:
    col = agent["col"]
    n = len(replies(col, "update"))
    client.pub(PREFIX + "cmd/update", json.dumps({"url": url, "sha256": "0" * 64, "id": uid}))
    assert col.wait(lambda: len(replies(col, "update")) > n, 60), "no reply to update"
    return replies(col, "update")[-1]


def test_url_with_crlf_is_refused_and_status_is_not_left_downloading(agent: dict, client: Client, web: HostileWeb) -> None:
    r = _update(agent, client, web.base + "/x\r\nX-Injected: 1", "crlf")
    assert r["ok"] is False and "control characters" in r["update"]["reason"]
    assert statuses(agent["col"], "crlf")[-1]["state"] == "rejected"
    assert still_serving(agent)


def test_url_redirect_to_ftp_is_refused(agent: dict, client: Client, web: HostileWeb) -> None:
    r = _update(agent, client, web.base + "/ftp", "ftp")
    assert r["ok"] is False and "redirect refused" in r["update"]["reason"]
    assert staged(agent) == []


def test_oversized_download_is_stopped_while_streaming_and_leaves_no_staging(agent: dict, client: Client,
                                                                           web: HostileWeb) -> None:
    # the module's agent allows 512 MiB; the server would send 2 GiB
    t0 = time.monotonic()
    r = _update(agent, client, web.base + "/big", "big")
    assert r["ok"] is False
    assert "over updates.max_bundle_bytes" in r["update"]["reason"] or "download_deadline_s" in r["update"]["reason"]
    assert time.monotonic() - t0 < 45  # stopped early: not the 2 GiB (generous for a loaded machine)
    print(f"oversized download refused in {time.monotonic() - t0:.1f} s: {r['update']['reason']}")
    assert staged(agent) == []


def test_slow_server_hits_the_total_deadline_not_a_per_read_timeout(agent: dict, client: Client, web: HostileWeb) -> None:
    t0 = time.monotonic()
    r = _update(agent, client, web.base + "/slow", "slow")
    took = time.monotonic() - t0
    assert r["ok"] is False and "download_deadline_s 3" in r["update"]["reason"], r
    # The server would trickle for 100 s, and every read succeeds within the 1 s read timeout: only the
    # total deadline ends it. Well under 100 s proves that; the exact 3 s + overhead is a loaded machine's.
    assert took < 30, took
    print(f"slow server cut off after {took:.1f} s (deadline 3 s)")
    assert staged(agent) == []


def test_plain_http_beyond_loopback_is_refused_unless_configured(agent: dict, client: Client) -> None:
    r = _update(agent, client, "http://example.invalid/b.tar.gz", "plain")
    assert r["ok"] is False and "updates.allow_http" in r["update"]["reason"]
    r = _update(agent, client, "ftp://127.0.0.1/b.tar.gz", "ftpdirect")
    assert r["ok"] is False and "only https URLs" in r["update"]["reason"]


def test_five_url_updates_at_once_download_one_at_a_time(agent: dict, client: Client, web: HostileWeb) -> None:
    col = agent["col"]
    n = len(replies(col, "update"))
    for i in range(5):
        client.pub(PREFIX + "cmd/update", json.dumps({"url": web.base + "/slow", "sha256": "0" * 64, "id": f"five{i}"}))
    # barrier: the four refusals are out while the first download trickles (its deadline is 3 s)
    assert col.wait(lambda: len(replies(col, "update")) >= n + 4, 60), replies(col, "update")[n:]
    assert len([p for p in staged(agent) if p.startswith("download-")]) <= 1
    assert col.wait(lambda: len(replies(col, "update")) >= n + 5, 60), replies(col, "update")[n:]
    got = replies(col, "update")[n:]
    # one update at a time: the controller answers the other four "already running" (or the downloader "busy")
    busy = [r for r in got if r.get("already_running")
            or "busy" in (r.get("error") or r.get("update", {}).get("reason", ""))]
    assert len(busy) == 4 and sum(not r["ok"] for r in got) == 5, got
    assert wait_until(lambda: staged(agent) == [], 30)


def test_message_over_the_packet_bound_never_reaches_the_agent(agent: dict, client: Client) -> None:
    col = agent["col"]
    before = vm_hwm_mb(agent["proc"].pid)
    n = len(replies(col, "status"))
    for _ in range(3):
        client.pub(PREFIX + "cmd/status", b"{" + b" " * (50 * 2**20) + b"}")
    client.pub(PREFIX + "cmd/status", b'{"id": "after"}')
    assert col.wait(lambda: any(r.get("id") == "after" for r in replies(col, "status")[n:]), 60)
    assert [r.get("id") for r in replies(col, "status")[n:]] == ["after"]  # the big ones were dropped unseen
    peak = vm_hwm_mb(agent["proc"].pid)
    print(f"three 50 MB commands: peak RSS {before:.0f} -> {peak:.0f} MB")
    assert peak < PEAK_RSS_BOUND_MB
