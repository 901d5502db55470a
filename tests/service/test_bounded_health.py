"""Health carries bounded fields only: what a remote sender names cannot grow every health message."""

from __future__ import annotations

import json

from agent.service.controller import MAX_OPERATION_CHARS, _bounded_name


def test_an_update_named_by_a_60_kb_url_shows_a_bounded_operation_in_health() -> None:
    """Found in review: `operation` held the update's whole name (its URL), up to the 64 KiB payload cap,
    and rode along in every health message while the update ran."""
    url = "http://127.0.0.1/" + "a" * 60_000 + ".tar.gz"
    shown = _bounded_name(f"update {url}")
    assert len(shown) == MAX_OPERATION_CHARS and shown.startswith("update http://127.0.0.1/aaa") and shown.endswith("\u2026")
    assert len(json.dumps({"operation": shown})) < 400
    assert _bounded_name("reload") == "reload"
