"""The serving session's in-flight record (`serving-*.inflight`, rewritten in place around every inference):
"1 <thread ids> #<inference>" while a run is in flight, "0" between runs. Read back after a death to tell which
threads ran the session and at which inference it died."""

from __future__ import annotations


def flight_threads(raw: bytes) -> set[int]:
    try:
        head, _, rest = raw.decode("ascii").strip().partition(" ")
        ids = rest.split(" #")[0]
        return {int(t, 16) for t in ids.split(",") if t} if head == "1" else set()
    except ValueError:
        return set()


def flight_point(raw: bytes) -> int | None:
    """The inference in flight when the process died (0: opening the session), from the in-flight record."""
    try:
        text = raw.decode("ascii").strip()
        return int(text.rsplit(" #", 1)[1]) if text.startswith("1 ") and " #" in text else None
    except (ValueError, IndexError):
        return None
