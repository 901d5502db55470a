"""How bundles reach the updater: MQTT chunks (`ChunkReceiver`), a URL with its sha256 (`Downloader`),
or a `.tar.gz` dropped into an inbox (`watch_inbox`). Every input here is bounded before it costs anything.

Bounds and policy (each a config key under `updates`, see docs/updates.md "Hostile inputs"):
- an offer is refused unless size <= max_bundle_bytes, fits the free disk, and its chunk size lies in
  [min_chunk_bytes, max_chunk_bytes]; received chunks are one byte each in a bitmap, data goes to a file;
- one update at a time is the update machine's state (agent.updates.machine, docs/updates.md), not a lock
  here: a new offer (or the same id offered again) supersedes a receiving delivery; an offer, download or
  inbox file while an update verifies, proves, switches or is on probation is refused "busy";
- a transfer idle for transfer_idle_s expires; a sweeper removes it and any orphaned transfer staging;
- a download has one total deadline (connect, status line, headers, body), size checked while streaming,
  https (http to loopback, or anywhere with allow_http), redirects only to allowed schemes, staging removed
  on every failure; a rollback or a newer offer cancels it;
- an inbox entry that is not a regular file is refused by lstat before any open; any exception in any path
  is a `rejected` verdict and the path keeps going.
"""

from __future__ import annotations

from agent.errors import UrlRefused
from agent.updates.chunks import MAX_CONTROL_BYTES, SWEPT_PREFIX, ChunkReceiver, Transfer
from agent.updates.download import LOOPBACK, Downloader, check_url
from agent.updates.inbox import InboxWatcher, _take_entry, inbox_entry, watch_inbox
from agent.updates.intake import (Delivery, RateLimitedWarnings, free_bytes, space_refusal, spawn_job,
                                  start_deliveries)

__all__ = ["LOOPBACK", "MAX_CONTROL_BYTES", "SWEPT_PREFIX", "ChunkReceiver", "Delivery", "Downloader", "InboxWatcher",
           "RateLimitedWarnings", "Transfer", "UrlRefused", "_take_entry", "check_url", "free_bytes", "inbox_entry",
           "space_refusal", "spawn_job", "start_deliveries", "watch_inbox"]
