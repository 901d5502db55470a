"""A flood of one warning (2,000 wrong-size chunks) is a few log lines with the count of those left out
(fault, issue 20: each wrong-size chunk logged its own warning, 2,000 lines for 2,000 chunks)."""

from __future__ import annotations

from typing import Any

from agent.updates.delivery import RateLimitedWarnings


class Lines:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **kw: Any) -> None:
        self.lines.append((event, kw))


def test_two_thousand_wrong_size_chunks_log_one_line_then_the_count() -> None:
    out = Lines()
    w = RateLimitedWarnings(out, interval_s=3600)
    for i in range(2000):
        w.warn("bundle.chunk_wrong_size", index=i)
    assert out.lines == [("bundle.chunk_wrong_size", {"suppressed": 0, "index": 0})]
    w.interval_s = 0  # the interval has passed: the next one says how many were left out
    w.warn("bundle.chunk_wrong_size", index=2000)
    assert out.lines[-1] == ("bundle.chunk_wrong_size", {"suppressed": 1999, "index": 2000})
    w.warn("bundle.chunk_not_written", index=1)  # another event has its own budget
    assert out.lines[-1][0] == "bundle.chunk_not_written"
