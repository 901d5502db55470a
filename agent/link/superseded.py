"""Retained documents superseded while a connection was down are not sent again.

A broker keeps, per topic, the retained message that reached it last. paho keeps every unacknowledged
QoS 1 publish (and every one made while disconnected) and sends them again after a reconnect, after what
`on_connect` published. A device that republishes its current state in `on_connect` (its facts,
update status, availability) would then have the broker retain the older document it had queued before
the link went down: on the aedes cluster a real agent's facts said v1 committed after it had committed
v2 (the self-test's facts, queued while the link was dead, sent after the connect's v2 facts).

`drop_queued` is called in `on_connect` before the current documents are published: what paho still
holds for those topics is older than them and goes. paho has no public way to withdraw a message; its
map of outgoing messages is read and trimmed under paho's own lock (paho-mqtt 2.x; 1.x has the same).
"""

from __future__ import annotations

from typing import Iterable

import paho.mqtt.client as paho


def drop_queued(client: paho.Client, topics: Iterable[str]) -> int:
    """Drop paho's not yet acknowledged publishes to `topics` (call on paho's thread, in `on_connect`,
    before publishing their current documents). Returns how many were dropped."""
    wanted = set(topics)
    with client._out_message_mutex:
        out = client._out_messages
        # waiting for a PUBACK: sent on this connection, so it reached the broker before what follows
        stale = [mid for mid, m in out.items()
                 if m.retain and m.topic in wanted and m.state != paho.mqtt_ms_wait_for_puback]
        for mid in stale:
            del out[mid]
    return len(stale)
