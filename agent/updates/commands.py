"""The update commands (`update`, `rollback`) as values: one parser and one "repeated" rule, shared by the
agent's controller and the fleet simulator (they each parsed, and their copies had come to differ on
when an `update` is a repeat).

Pure: no I/O, no threads. The caller takes the machine and runs the work; this module only says what
the command asks for, or the error its reply carries, and whether it is the last committed update again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from agent.updates.machine import Snapshot, State

MAX_ID_CHARS = 100
NEEDS_URL = "update needs {\"url\": \"http(s)://...\", \"sha256\": \"...\"}"


class CommandRefused(ValueError):
    """The command's payload is not one the machine can take; its text is the reply's `error`."""


@dataclass(frozen=True)
class UrlUpdate:
    """`update`: fetch `url`, whose archive must hash to `sha256`; `id` names the update (the URL's file)."""

    url: str
    sha256: str
    id: str


@dataclass(frozen=True)
class Rollback:
    """`rollback`: back to the previous committed bundle; `id` names it in the statuses."""

    id: str


def parse_update_command(name: str, payload: Mapping[str, Any]) -> UrlUpdate | Rollback:
    """`update` or `rollback` with its payload as a value, or CommandRefused naming what is wrong."""
    if name == "rollback":
        return Rollback(str(payload.get("id", "rollback"))[:MAX_ID_CHARS])
    if name != "update":
        raise CommandRefused(f"not an update command: {name!r} (update, rollback)")
    url, sha = payload.get("url"), payload.get("sha256")
    if not isinstance(url, str) or not isinstance(sha, str):
        raise CommandRefused(NEEDS_URL)
    return UrlUpdate(url, sha, str(payload.get("id", url.rsplit("/", 1)[-1]))[:MAX_ID_CHARS])


def is_repeat(cmd: UrlUpdate, snap: Snapshot, url_committed: tuple[str, str] | None,
              current_id: str | None, committed_id: str | None) -> bool:
    """Whether `cmd` is the last URL update this process committed, sent again (a fleet operator resumed
    after its command went out): the same id and sha256, the machine still `committed` for it, and its
    bundle both current and committed in the store. Anything in between (a rollback, another update, a
    restart, which forgets `url_committed`) makes it an update like any other (docs/updates.md)."""
    return (snap.update == cmd.id and snap.state is State.COMMITTED and url_committed == (cmd.id, cmd.sha256)
            and snap.bundle is not None and current_id == snap.bundle == committed_id)


def repeat_reply(cmd: UrlUpdate, last_update: Mapping[str, Any] | None) -> dict[str, Any]:
    """The answer to a repeat: its verdict (the last status when it names this update), never a second install."""
    verdict = dict(last_update) if last_update is not None and last_update.get("update") == cmd.id \
        else {"update": cmd.id, "state": "committed"}
    return {"ok": True, "repeated": True, "update": verdict}
