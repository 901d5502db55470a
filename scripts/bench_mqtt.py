"""MQTT benchmark against a local Mosquitto started here: publish throughput through the agent's
outbox (QoS 0 and 1, batching on and off), the drain rate of an outbox spilled to disk while the
broker was away, and a raw paho publish loop of the same payloads as the baseline in the same run
(paho's own defaults: its in-flight window of 20; a window of 1000 is slower on a local broker and
flattered the outbox).

The agent's outbox runs with its shipped defaults unless --tuned is given; every setting the benchmark
changes from the shipped defaults is printed above the table. With the defaults, a burst larger than
`outbox.memory_messages` spills only its overflow to SQLite: "rows written" is what went to disk, beside
the most the overflow could be (the burst less what memory holds). The 1-minute load average is printed
beside every figure: on a shared machine a ratio means something only with it.

The hot-path cost of the held-in-memory counter (agent/link/held.py, issue 43) is measured in the same run:
the QoS 1 rows again with the counter switched off (its map closed: the "before"), and the counter's own calls
per result in a tight loop beside an empty method call.

Usage: python scripts/bench_mqtt.py [--messages 20000] [--tuned]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import paho.mqtt.client as paho

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from agent.config import MqttConfig, OutboxConfig  # noqa: E402
from agent.link.mqtt import MqttLink  # noqa: E402
from agent.link.outbox import Outbox  # noqa: E402
from agent.serving.sinks import OutboxSink  # noqa: E402
from brokers import Broker, Collector  # noqa: E402

TOPIC = "edge/bench/predictions"
T = TypeVar("T")
SUB: list[Collector] = []  # the run's live subscriber


def result(i: int) -> dict:
    return {"boot": 1, "seq": i, "captured_at": 1795965633.108598, "source": f"{i:04d}.png", "frame_index": i,
            "bundle": {"name": "digits-classifier", "version": 1}, "variant": "int8",
            "provider": "CPUExecutionProvider", "batch": 1,
            "timings": {"queue_ms": 0.4, "preprocess_ms": 0.5, "inference_ms": 1.0, "postprocess_ms": 0.1, "total_ms": 2.1},
            "result": {"type": "classification", "top": [{"class_id": 3, "label": "three", "score": 0.98},
                                                         {"class_id": 5, "label": "five", "score": 0.01}]}}


def wait_until(pred, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise TimeoutError("benchmark step did not finish")
        time.sleep(0.002)


def settings(n: int, tuned: bool) -> dict[str, dict]:
    """The outbox and MQTT settings the agent runs with: the shipped defaults, or tuned for a burst of n."""
    return {"outbox": {"memory_messages": n + 10} if tuned else {}, "mqtt": {"max_inflight": 1000} if tuned else {}}


def changed_settings(chosen: dict[str, dict]) -> list[str]:
    """Each setting that differs from the shipped default, as `key: value (default: d)`."""
    defaults = {"outbox": OutboxConfig(), "mqtt": MqttConfig()}
    return [f"{section}.{k}: {v} (shipped default: {getattr(defaults[section], k)})"
            for section, values in chosen.items() for k, v in values.items() if getattr(defaults[section], k) != v]


def through_agent(port: int, tmp: Path, n: int, qos: int, batch: int, chosen: dict[str, dict],
                  held: bool = True) -> tuple[float, int]:
    """Results/s from OutboxSink.write until the outbox is empty (QoS 1: every message acknowledged).
    `held` False: the held-in-memory counter off (the code before issue 43's counter, bar a no-op call)."""
    box = Outbox(tmp / f"box-{qos}-{batch}-{held}.sqlite", OutboxConfig(**chosen["outbox"]))
    if not held:
        box._held.stopped()  # its map closed: every counter call returns at once
    link = MqttLink(MqttConfig(enabled=True, port=port, **chosen["mqtt"]), "bench", tmp, box,
                    lambda c: {"ok": True}, lambda: {}).start()
    link.connected.wait(10)
    wait_until(lambda: box.connected, 10)  # the pump thread has seen it: a put before goes to disk, durable
    sink = OutboxSink(box, TOPIC, qos, batch)
    payloads = [result(i) for i in range(n)]
    t0 = time.perf_counter()
    for r in payloads:
        sink.write(r)
    sink.close()
    wait_until(lambda: box.depth == 0 and (qos == 0 or box.acked >= box.sent))
    dt = time.perf_counter() - t0
    disk = box.spilled
    link.stop(drain_s=0)
    return n / dt, disk


def drain(port: int, broker: Broker, tmp: Path, n: int, chosen: dict[str, dict]) -> tuple[float, int, float]:
    """An outbox filled while the broker is down, then drained: results/s from reconnect to empty, the rows
    spilled, and the CPU seconds of the drain."""
    broker.kill()
    box = Outbox(tmp / "spilled.sqlite", OutboxConfig())
    for i in range(n):
        box.put(TOPIC, json.dumps(result(i)).encode(), 1)
    box.pump(lambda m: None, 1)  # disconnected: everything goes to disk
    on_disk = box.stats()["on_disk"]
    broker.start()
    link = MqttLink(MqttConfig(enabled=True, port=port, **chosen["mqtt"]), "bench", tmp, box,
                    lambda c: {"ok": True}, lambda: {})
    t0, c0 = time.perf_counter(), time.process_time()
    link.start()
    wait_until(lambda: box.depth == 0)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    link.stop(drain_s=0)
    return n / dt, on_disk, cpu


def raw_paho(port: int, n: int, qos: int) -> float:
    """What a user would write: paho with its defaults (in-flight window 20, unbounded queue)."""
    c = paho.Client(paho.CallbackAPIVersion.VERSION2)
    acked = [0]
    c.on_publish = lambda *a: acked.__setitem__(0, acked[0] + 1)
    c.connect("127.0.0.1", port)
    c.loop_start()
    payloads = [json.dumps(result(i)).encode() for i in range(n)]
    t0 = time.perf_counter()
    for p in payloads:
        c.publish(TOPIC, p, qos=qos)
    wait_until(lambda: acked[0] >= n)
    dt = time.perf_counter() - t0
    c.loop_stop()
    c.disconnect()
    return n / dt


def settle(sub: Collector, quiet_s: float = 0.5, timeout: float = 120) -> None:
    """Wait until the subscriber has received what the broker still had to forward: a QoS 0 burst of 47,000/s
    is still being delivered when the next step starts, and that step would pay for it."""
    end = time.monotonic() + timeout
    seen = -1
    while len(sub.messages) != seen and time.monotonic() < end:
        seen = len(sub.messages)
        time.sleep(quiet_s)
    sub.messages.clear()


def cpu_of(step: Callable[..., T], *args: Any) -> tuple[T, float]:
    """The step's value and the CPU seconds this process spent on it (the subscriber settled first)."""
    settle(SUB[0])
    t0 = time.process_time()
    value = step(*args)
    return value, time.process_time() - t0


def held_calls(n: int) -> tuple[float, float]:
    """ns per result of the counter's hot-path calls (entered, then left and sent as the pump batches them,
    here per result: the worst case), and of an empty method call, in a tight loop."""
    from agent.link.held import HeldCounter

    class Empty:
        def entered(self) -> None:
            pass

    with tempfile.TemporaryDirectory() as d:
        counter = HeldCounter(Path(d) / "held")
        t0 = time.perf_counter()
        for _ in range(n):
            counter.entered()
            counter.sent(1)
            counter.left(1, 1)
        held_ns = (time.perf_counter() - t0) / n * 1e9
        empty = Empty()
        t0 = time.perf_counter()
        for _ in range(n):
            empty.entered()
            empty.entered()
            empty.entered()
        counter.stopped()
    return held_ns, (time.perf_counter() - t0) / n * 1e9


def load() -> float:
    return os.getloadavg()[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=20000)
    ap.add_argument("--tuned", action="store_true",
                    help="size the outbox's memory for the whole burst and raise max_inflight (printed)")
    args = ap.parse_args()
    n = args.messages
    chosen = settings(n, args.tuned)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        broker = Broker(tmp / "broker").start()
        sub = Collector(broker.port, ["edge/#"])  # a live subscriber, as in the field
        SUB[:] = [sub]
        try:
            rows = []
            for qos in (0, 1):
                (base, cpu) = cpu_of(raw_paho, broker.port, n, qos)
                rows.append((f"raw paho publish loop, QoS {qos}", base, None, "-", cpu / n, load()))
                for batch in (1, 10):
                    (rate, disk), cpu = cpu_of(through_agent, broker.port, tmp, n, qos, batch, chosen)
                    rows.append((f"agent outbox, QoS {qos}, batch {batch}", rate, rate / base, disk, cpu / n, load()))
            for qos in (0, 1):  # before/after for the held counter, interleaved: off, on, off, on
                for held in (False, True, False, True):
                    (rate, disk), cpu = cpu_of(through_agent, broker.port, tmp, n, qos, 1, chosen, held)
                    rows.append((f"outbox QoS {qos}, batch 1, held counter {'on' if held else 'off'}", rate, None,
                                 disk, cpu / n, load()))
            settle(sub)
            rate, on_disk, cpu = drain(broker.port, broker, tmp, n, chosen)
            base, raw_cpu = cpu_of(raw_paho, broker.port, n, 1)
            rows.append(("raw paho publish loop, QoS 1, again", base, None, "-", raw_cpu / n, load()))
            rows.append((f"drain of {on_disk} spilled results, QoS 1", rate, rate / base, on_disk, cpu / n, load()))
        finally:
            sub.close()
            broker.stop()
    print(f"local mosquitto, {n} prediction results (~{len(json.dumps(result(0)))} bytes each), a live subscriber")
    changed = changed_settings(chosen)
    print("agent settings changed from the shipped defaults: " + ("; ".join(changed) if changed else "none") + "\n")
    memory = OutboxConfig(**chosen["outbox"]).memory_messages
    print(f"{'mode':40} {'results/s':>10} {'vs raw':>7} {'rows written':>12} {'CPU us/result':>14} {'load 1m':>8}")
    for name, rate, ratio, disk, cpu, avg in rows:
        print(f"{name:40} {rate:>10.0f} {('%.2f' % ratio) if ratio else '-':>7} {disk!s:>12} {cpu * 1e6:>14.0f} "
              f"{avg:>8.2f}")
    print("\nvs raw: against the raw paho loop (paho's defaults) at the same QoS in this run, the drain against the "
          "raw loop run just after it (batched rows count results, not messages)")
    print("CPU us/result: this process's CPU (all threads) over the step, per result (the drain's from the "
          "reconnect on)")
    print(f"rows written: results written to SQLite; the overflow of a burst is at most {max(0, n - memory)} "
          f"({n} results less outbox.memory_messages {memory}), less what the broker took meanwhile")
    held_ns, empty_ns = held_calls(max(n, 100000))
    print(f"held counter calls per result (entered + sent + left, unbatched): {held_ns:.0f} ns; three empty method "
          f"calls: {empty_ns:.0f} ns; load 1m {load():.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
