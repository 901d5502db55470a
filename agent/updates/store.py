"""The bundle store in the state directory: content-addressed bundle directories behind two symlinks.

  store/bundles/<name>-v<version>-<sha12>/   verified bundles, never modified
  store/current   -> bundles/...             what serves now (possibly on probation)
  store/committed -> bundles/...             the last bundle that passed probation
  store/history.json                         committed ids, oldest first (for rollback)
  store/seeds.json                           bundles the operator installed (config `bundle`): id -> manifest sha256

A bundle's files and directories are fsynced before it is renamed into `bundles/`, and `bundles/`
before a symlink may point at it: a switch never reaches the disk ahead of the data it names. Every
switch is a new symlink renamed over the old one (atomic), then a directory fsync; at boot an
uncommitted `current` is put back to `committed`, so power loss at any step boots the last committed
bundle.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from agent.bundle.load import Bundle, load_bundle
from agent.errors import BundleError
from agent.fsio import fsync_dir, read_json, write_json_atomic
from agent.logsetup import get_logger

log = get_logger("store")


@dataclass(frozen=True)
class StoreEntry:
    id: str
    path: Path
    current: bool
    committed: bool


def fsync_tree(root: Path) -> None:
    """Make a directory tree durable: every file's data, then every directory's entries, deepest first."""
    dirs = []
    for dirpath, _dirnames, filenames in os.walk(root):
        dirs.append(Path(dirpath))
        for name in filenames:
            p = Path(dirpath) / name
            if p.is_symlink():
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for d in reversed(dirs):
        fsync_dir(d)


def bundle_id(bundle: Bundle) -> str:
    m = bundle.manifest
    return f"{m.name}-v{m.version}-{bundle.manifest_sha256[:12]}"


class BundleStore:
    def __init__(self, root: Path):
        self.root = root
        self.bundles = root / "bundles"
        self.staging = root / "staging"
        for d in (self.bundles, self.staging):
            d.mkdir(parents=True, exist_ok=True)

    # -- reading ---------------------------------------------------------------------------------------
    def _target(self, link: str) -> str | None:
        p = self.root / link
        if not p.is_symlink():
            return None
        target = Path(os.readlink(p)).name
        return target if (self.bundles / target).is_dir() else None

    @property
    def current_id(self) -> str | None:
        return self._target("current")

    @property
    def committed_id(self) -> str | None:
        return self._target("committed")

    def path(self, bid: str) -> Path:
        return self.bundles / bid

    def history(self) -> list[str]:
        return [h for h in (read_json(self.root / "history.json", [], expect=list) or []) if (self.bundles / h).is_dir()]

    def entries(self) -> list[StoreEntry]:
        cur, com = self.current_id, self.committed_id
        return [StoreEntry(p.name, p, p.name == cur, p.name == com) for p in sorted(self.bundles.iterdir()) if p.is_dir()]

    def new_staging(self, prefix: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=prefix, dir=self.staging))

    # -- writing ---------------------------------------------------------------------------------------
    def add(self, staged: Path, bundle: Bundle) -> str:
        """Move a verified staged bundle into the store (rename: atomic within one filesystem)."""
        bid = bundle_id(bundle)
        dest = self.bundles / bid
        if dest.exists():
            shutil.rmtree(staged, ignore_errors=True)  # the same content is already stored
        else:
            fsync_tree(staged)  # the data is on disk before any name points at it
            staged.rename(dest)
            fsync_dir(self.bundles)
        return bid

    def _switch(self, link: str, bid: str) -> None:
        if not (self.bundles / bid).is_dir():
            raise BundleError(f"{self.bundles / bid}: no such bundle in the store")
        tmp = self.root / f".{link}.tmp"
        tmp.unlink(missing_ok=True)
        os.symlink(Path("bundles") / bid, tmp)
        os.replace(tmp, self.root / link)
        fsync_dir(self.root)

    def activate(self, bid: str) -> None:
        """Point `current` at a bundle (probation starts); `committed` is unchanged."""
        self._switch("current", bid)

    def commit(self, bid: str) -> None:
        self._switch("current", bid)
        self._switch("committed", bid)
        hist = [h for h in self.history() if h != bid] + [bid]
        write_json_atomic(self.root / "history.json", hist)

    def revert_current(self) -> str | None:
        """Put `current` back on `committed` (an update rolled back, or interrupted by a crash)."""
        com = self.committed_id
        if com is not None and self.current_id != com:
            self._switch("current", com)
        return com

    def previous_committed(self) -> str | None:
        hist = self.history()
        com = self.committed_id
        older = [h for h in hist if h != com]
        return older[-1] if older else None

    def recover(self) -> str | None:
        """At boot: clear staging leftovers, undo an uncommitted switch. Returns the committed id."""
        for p in self.staging.iterdir():
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        cur, com = self.current_id, self.committed_id
        if com is not None and cur != com:
            log.warning("store.uncommitted_switch_reverted", current=cur, committed=com)
            self.revert_current()
        self.prune_uncommitted()
        return com

    def prune_uncommitted(self) -> list[str]:
        """At boot: a bundle that was stored but never committed (a crash between the switch and the commit)
        is removed now, not at a later update's prune: it can hold hundreds of MB and nothing names it."""
        keep = {self.current_id, self.committed_id} | set(self.history())
        removed = []
        for p in sorted(self.bundles.iterdir()):
            if p.name not in keep:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                removed.append(p.name)
        if removed:
            fsync_dir(self.bundles)
            log.warning("store.uncommitted_pruned", removed=removed)
        return removed

    def import_bundle(self, src: Path) -> str:
        """Copy a bundle directory into the store and commit it (the initial bundle)."""
        staged = self.new_staging("import-")
        shutil.rmtree(staged)
        shutil.copytree(src, staged)
        bundle = load_bundle(staged, check_contracts=False)
        bid = self.add(staged, bundle)
        self.commit(bid)
        # trusted as what the operator installed (it needs no signature), pinned to its manifest hash
        seeds = read_json(self.root / "seeds.json", {}, expect=dict) or {}
        write_json_atomic(self.root / "seeds.json", {**seeds, bid: bundle.manifest_sha256})
        return bid

    def seed_sha256(self, bid: str) -> str | None:
        """The manifest hash recorded when the operator's bundle seeded the store; None for pushed bundles."""
        return (read_json(self.root / "seeds.json", {}, expect=dict) or {}).get(bid)

    def prune(self, keep: int) -> list[str]:
        """Keep the newest `keep` committed bundles, and never the ones in use."""
        protected = {self.current_id, self.committed_id} | set(self.history()[-keep:])
        removed = []
        for e in self.entries():
            if e.id not in protected:
                shutil.rmtree(e.path, ignore_errors=True)
                removed.append(e.id)
        if removed:
            write_json_atomic(self.root / "history.json", [h for h in self.history() if h not in removed])
        return removed

    def serving_id(self) -> str | None:
        """The committed bundle, else (corrupt on disk) the newest earlier one whose files verify.

        Reads files and hashes only: opening sessions is the self-test child's job."""
        candidates = [self.committed_id] + list(reversed(self.history()))
        seen: set[str] = set()
        for bid in candidates:
            if bid is None or bid in seen:
                continue
            seen.add(bid)
            try:
                load_bundle(self.path(bid), check_contracts=False)
            except BundleError as exc:
                log.error("store.bundle_unloadable", bundle=bid, reason=str(exc))
                continue
            if bid != self.committed_id:
                log.warning("store.fell_back", to=bid, committed=self.committed_id)
                self.commit(bid)
            return bid
        return None
