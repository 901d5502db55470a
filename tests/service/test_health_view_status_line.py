"""systemd's STATUS= line never says "None" (fault, issue 20: `STATUS=NOT serving: None` before READY)."""

from __future__ import annotations

from agent.service.health_view import status_line


def test_status_line_before_boot_names_no_none() -> None:
    line = status_line(False, None, None)
    assert "None" not in line and line.startswith("NOT serving: ")
    assert status_line(False, None, "boot in progress") == "NOT serving: boot in progress"
