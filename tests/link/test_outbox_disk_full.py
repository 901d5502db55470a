"""The outbox and the link on a full disk: a real tmpfs of a few MiB, filled to the last page.

Faults (issue 20): a message was popped before its spill write raised (88 results lost, `dropped: 0`,
no `outbox.dropped` event); a reconnect while the disk was full raised in `on_connect` before it
subscribed (connected, but no prediction, health or reply for as long as the broker stayed up)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from agent.config import OutboxConfig
from agent.link.outbox import Message, Outbox
from agentproc import demo_config
from brokers import MOSQUITTO, Broker, Collector
from full_disk import fill  # small_disk, the fixture: tests/conftest.py
from waiting import wait_until

DEVICE = "dev-df"
PREFIX = f"edge/{DEVICE}/"
BOUND = 60  # outbox.memory_messages: what a full disk may keep in memory
FPS = 15  # the agent's rate in the broker test: BOUND is 4 s of results


class Wire:
    def __init__(self) -> None:
        self.sent: list[int] = []
        self.mid = 0

    def __call__(self, msg: Message) -> int:
        self.mid += 1
        self.sent.append(json.loads(msg.payload)["seq"])
        return self.mid


def drain(box: Outbox, rounds: int) -> Wire:
    """The broker is back: pump `rounds` times, each sent message acknowledged; what was sent."""
    box.on_connected()
    wire = Wire()
    for _ in range(rounds):
        box.pump(wire, 100)
        for mid in range(1, wire.mid + 1):
            box.ack(mid)
    return wire


def test_full_disk_with_the_broker_away_keeps_results_in_memory_up_to_the_bound_and_counts_the_rest(
        small_disk: Path) -> None:
    box = Outbox(small_disk / "outbox.sqlite", OutboxConfig(memory_messages=BOUND))
    box.on_disconnected()
    filler = fill(small_disk)
    for i in range(BOUND):  # the broker is away and nothing can be spilled
        box.put("t", json.dumps({"seq": i}).encode(), 1)
        box.pump(Wire(), 10)
    s = box.stats()
    assert s["dropped"] == 0 and s["depth"] == BOUND and s["memory_only"] == BOUND, s
    for i in range(BOUND, BOUND + 25):  # beyond the bound: the oldest go, each one counted
        box.put("t", json.dumps({"seq": i}).encode(), 1)
        box.pump(Wire(), 10)
    s = box.stats()
    assert s["dropped"] == 25 and s["depth"] == BOUND, s
    # space returns: the next pump spills what memory held, then the broker returns and it all drains
    filler.unlink()
    box.pump(Wire(), 10)
    assert box.stats()["on_disk"] == BOUND and box.stats()["memory_only"] == 0
    wire = drain(box, 20)
    assert wire.sent == list(range(25, BOUND + 25))  # in order; only the 25 counted drops are missing
    box.close()


def test_drops_of_results_sent_but_never_acknowledged_are_counted_as_such(small_disk: Path) -> None:
    """The broker dies with results in flight: they go back to memory, the full disk refuses them, and
    beyond the bound the oldest (those sent) are dropped. The subscriber may hold them (QoS 1 delivers
    before PUBACK), so the event says how many of the drops were sent: the loss is within that of the count."""
    box = Outbox(small_disk / "outbox.sqlite", OutboxConfig(memory_messages=BOUND))
    box.on_connected()
    filler = fill(small_disk)
    for i in range(10):  # sent, never acknowledged
        box.put("t", json.dumps({"seq": i}).encode(), 1)
    box.pump(Wire(), 100)
    assert box.stats()["inflight"] == 10
    box.on_disconnected()  # back to memory; the spill fails on the full disk
    for i in range(10, BOUND + 25):
        box.put("t", json.dumps({"seq": i}).encode(), 1)
        box.pump(Wire(), 100)
    s = box.stats()
    assert s["dropped"] == 25 and box.dropped_unacked == 10, (s, box.dropped_unacked)
    filler.unlink()
    box.close()


def test_full_disk_while_connected_to_a_slow_broker_loses_nothing_below_the_bound(small_disk: Path) -> None:
    box = Outbox(small_disk / "outbox.sqlite", OutboxConfig(memory_messages=BOUND))
    box.on_connected()
    fill(small_disk)
    wire = Wire()
    for i in range(BOUND + 10):  # no PUBACK: the backlog passes memory_messages and the spill fails
        box.put("t", json.dumps({"seq": i}).encode(), 1)
    box.pump(wire, 5)
    s = box.stats()
    assert s["depth"] == BOUND + 5 and s["dropped"] == 5, s  # 5 in flight + the bound; the 5 oldest counted
    for _ in range(BOUND):  # the broker catches up: each PUBACK lets the next one go, in order
        for mid in range(1, wire.mid + 1):
            box.ack(mid)
        box.pump(wire, 5)
    assert wire.sent == list(range(5)) + list(range(10, BOUND + 10))
    assert box.stats()["dropped"] == 5


def test_results_a_stop_on_a_full_disk_cannot_keep_are_counted_in_the_next_boot(small_disk: Path) -> None:
    """Issue 43: with the disk full and the broker away, a stop logged `outbox.lost_at_stop` and the results
    vanished: `dropped` stayed 0 and the next boot did not know. The count goes into a file allocated while
    there was space, and the next boot adds it to `dropped` (health's outbox section) once."""
    path = small_disk / "outbox.sqlite"
    box = Outbox(path, OutboxConfig(memory_messages=BOUND))
    box.on_disconnected()
    filler = fill(small_disk)
    for i in range(17):  # nothing can be spilled: all in memory
        box.put("t", json.dumps({"seq": i}).encode(), 1)
    box.close()
    filler.unlink()
    again = Outbox(path, OutboxConfig(memory_messages=BOUND))
    s = again.stats()
    assert s["dropped"] == 17 and s["lost_at_previous_stop"] == 17, s
    again.close()
    third = Outbox(path, OutboxConfig(memory_messages=BOUND))  # counted once, and the total kept
    s = third.stats()
    assert s["dropped"] == 17 and s["lost_at_previous_stop"] == 0, s
    third.close()


pytestmark_agent = pytest.mark.skipif(not Path(MOSQUITTO).exists() and not os.environ.get("CI"),
                                      reason="mosquitto is not installed")


@pytestmark_agent
@pytest.mark.slow
@pytest.mark.idle  # 6.9 s of broker restarts for 2 s of CPU
def test_broker_restarts_while_the_disk_is_full_deliver_and_count_every_drop(tmp_path: Path, small_disk: Path,
                                                                            agent_process) -> None:
    broker = Broker(tmp_path / "broker").start()
    sub = Collector(broker.port, [PREFIX + "predictions", PREFIX + "health", PREFIX + "cmd/status/reply"],
                    client_id="recorder-df", persistent=True)
    assert sub.wait(lambda: sub.connects >= 1, 30)
    assert broker.wait_saved(after=time.time()), "mosquitto never autosaved the persistent subscription"
    cfg = demo_config(tmp_path, port=broker.port, device_id=DEVICE, state_dir=str(small_disk / "state"),
                      source={"max_fps": FPS}, outbox={"memory_messages": BOUND})
    agent = agent_process(cfg).start()
    produced_seqs = lambda: [r["seq"] for r in agent.results()]  # noqa: E731
    got = lambda: {json.loads(m.payload)["seq"] for m in sub.on(PREFIX + "predictions")}  # noqa: E731
    try:
        assert sub.wait(lambda: len(got()) >= 10, 90), agent.log_text()[-3000:]
        filler = fill(small_disk)
        # 1. a short outage, under the bound: every result arrives once the broker is back. The outage lasts
        # 10 results, the broker's start, and the agent's next reconnect (up to 1 s): well under BOUND / FPS
        # (4 s). At 40 fps and 20 results it was 1.5 s against 1.5 s, and under load the bound was passed
        # (CI, 7 December: result 12 missing; a run at load 6: four drops counted, two of them missing).
        broker.kill()
        t0 = time.monotonic()
        wait_until(lambda: len(produced_seqs()) > max(got()) + 10, 30)
        broker.start()
        t_back = time.monotonic()
        cut = max(produced_seqs())
        assert sub.wait(lambda: set(range(1, cut + 1)) <= got(), 60), \
            f"lost with the disk full: {sorted(set(range(1, cut + 1)) - got())[:20]} (drops counted, the outage " \
            f"{time.monotonic() - t0:.1f} s: {agent.events('outbox.dropped')[-1:]})"
        print(f"outage 1: {t_back - t0:.1f} s, all {cut} results delivered {time.monotonic() - t_back:.1f} s "
              f"after the broker returned, disk full")
        # the reconnect happened with the disk full: it is not mute (a command is answered)
        sub.c.publish(PREFIX + "cmd/status", b'{"id": "full"}', qos=1)
        assert sub.wait(lambda: sub.on(PREFIX + "cmd/status/reply"), 30), "connected but mute"
        # 2. a long outage, over the bound: drops are counted, and exactly those are missing
        broker.kill()
        agent.wait_event("outbox.dropped", timeout=60)
        broker.start()
        filler.unlink()  # space returns while the broker is up
        t_free = time.monotonic()
        n = max(produced_seqs())
        assert sub.wait(lambda: max(got()) >= n + 20, 60), "no delivery after the disk was freed"
        print(f"space returned: 20 newer results delivered {time.monotonic() - t_free:.1f} s later")
        assert agent.stop(60) == 0
        produced = produced_seqs()
        assert sub.wait(lambda: max(got()) >= max(produced), 30)
    finally:
        agent.kill()
        sub.close()
        broker.stop()
    lost = sorted(set(produced) - got())
    dropped = agent.events("outbox.dropped")
    total = dropped[-1]["total"]
    assert {e["reason"] for e in dropped} == {"disk"}, dropped
    # A result sent once and dropped before its PUBACK (the broker was killed) may have reached the
    # subscriber: the count is exact up to those, which the event names (a run under load: counted 5, lost 4).
    unacked = dropped[-1]["unacknowledged_total"]
    assert total > 0 and total - unacked <= len(lost) <= total, \
        f"lost {len(lost)} but counted {total} ({unacked} unacknowledged): {lost[:20]}"
    print(f"disk full: produced {len(produced)}, dropped and counted {total}, lost uncounted 0")
