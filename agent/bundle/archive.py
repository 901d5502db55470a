"""Bundles as `.tar.gz`: deterministic packing and an unpacker that trusts nothing in the archive.

Unpacking refuses absolute paths, `..`, links, devices, oversized members and too many entries
(directories count), and writes into a fresh directory so a refused archive leaves nothing behind.
`unpack_signed` reads the manifest and its signature first and verifies them before writing anything,
then streams each member, hashing it against the signed manifest and refusing the first mismatch.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import shutil
import tarfile
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterator, Literal

from agent.bundle.signing import SignatureCheck, verify_manifest_bytes
from agent.errors import ArchiveError
from agent.hashing import sha256_bytes
from agent.vocabulary.manifest import MANIFEST_NAME, SIGNATURE_NAME, parse_manifest

_CHUNK = 1 << 20


@dataclass(frozen=True)
class UnpackLimits:
    max_member_bytes: int = 512 << 20
    max_total_bytes: int = 2 << 30
    max_files: int = 1000            # entries: files and directories both count
    max_manifest_bytes: int = 1 << 20


def pack(src: Path, out: Path) -> Path:
    """Write `src`'s regular files into `out` (.tar.gz), sorted, with zeroed owners and times."""
    src, out = Path(src), Path(out)
    # the manifest and its signature first: a device verifies them before it unpacks anything else
    head = {MANIFEST_NAME: 0, SIGNATURE_NAME: 1}
    files = sorted((p for p in src.rglob("*") if p.is_file() and not p.is_symlink()),
                   key=lambda p: (head.get(p.relative_to(src).as_posix(), 2), p.relative_to(src).as_posix()))
    if not files:
        raise ArchiveError(f"{src}: nothing to pack")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for p in files:
                info = tarfile.TarInfo(p.relative_to(src).as_posix())
                info.size = p.stat().st_size
                info.mode = 0o644
                info.mtime = 0
                with open(p, "rb") as f:
                    tar.addfile(info, f)
    tmp.replace(out)
    return out


def _safe_name(archive: Path, name: str) -> PurePosixPath:
    p = PurePosixPath(name)
    if p.is_absolute() or name.startswith(("/", "\\")):
        raise ArchiveError(f"{archive}: member {name!r} has an absolute path")
    if any(part == ".." for part in p.parts) or "\\" in name:
        raise ArchiveError(f"{archive}: member {name!r} escapes the bundle (path traversal)")
    parts = [q for q in p.parts if q not in ("", ".")]
    if not parts:
        raise ArchiveError(f"{archive}: member {name!r} has an empty path")
    return PurePosixPath(*parts)


def unpack(archive: Path, dest: Path, limits: UnpackLimits = UnpackLimits(),
           expected: dict[str, str] | None = None) -> Path:
    """Unpack into `dest` (which must not exist). Returns `dest`. Raises ArchiveError, leaving nothing.

    With `expected` (relative path -> sha256), a member not listed or whose bytes hash differently is
    refused as it is read, before the rest of the archive is unpacked.
    """
    archive, dest = Path(archive), Path(dest)
    if dest.exists():
        raise ArchiveError(f"{dest}: already exists; unpack into a new directory")
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".unpack-", dir=dest.parent))
    work.chmod(0o755)
    try:
        _extract(archive, work, limits, expected)
        work.rename(dest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return dest


def read_head(archive: Path, limits: UnpackLimits = UnpackLimits()) -> tuple[bytes | None, bytes | None]:
    """The manifest and signature bytes, read without writing anything. Every header on the way is checked
    and counted against the limits; `pack` puts both first, so a well-formed bundle costs two headers, and
    the scan stops at the first other file (an archive with its manifest later is not a bundle)."""
    manifest = sig = None
    with _guarded(archive):
        with tarfile.open(archive, mode="r:gz") as tar:
            for member, rel in _members(archive, tar, limits):
                name = rel.as_posix()
                if member.isfile() and name not in (MANIFEST_NAME, SIGNATURE_NAME):
                    # `pack` writes the manifest and signature first: the head ends at the first other file,
                    # so an unsigned (or foreign) archive costs one header, not a pass over every member
                    break
                if name in (MANIFEST_NAME, SIGNATURE_NAME) and member.isfile():
                    if member.size > limits.max_manifest_bytes:
                        raise ArchiveError(f"{archive}: {name} is {member.size} bytes, over {limits.max_manifest_bytes}")
                    src = tar.extractfile(member)
                    data = src.read(limits.max_manifest_bytes + 1) if src is not None else b""
                    if name == MANIFEST_NAME:
                        manifest = data
                    else:
                        sig = data
                    if manifest is not None and sig is not None:
                        break
    return manifest, sig


def unpack_signed(archive: Path, dest: Path, limits: UnpackLimits, trusted: tuple[Path, ...] | list[Path],
                  allow_unsigned: bool = False) -> tuple[Path, SignatureCheck]:
    """Signature first: verify bundle.yaml against bundle.sig, then unpack only what it lists, hashed."""
    archive = Path(archive)
    manifest, sig = read_head(archive, limits)
    if manifest is None:
        raise ArchiveError(f"{archive}: no {MANIFEST_NAME} in the archive: not a bundle")
    check = verify_manifest_bytes(manifest, sig, trusted, allow_unsigned, where=f"{archive}: {SIGNATURE_NAME}")
    m = parse_manifest(manifest.decode("utf-8", errors="replace"), where=f"{archive}: {MANIFEST_NAME}")
    expected = {**dict(m.files), MANIFEST_NAME: sha256_bytes(manifest)}
    if sig is not None:
        expected[SIGNATURE_NAME] = sha256_bytes(sig)
    return unpack(archive, dest, limits, expected), check


class _guarded:
    """Turn what a broken archive raises into one ArchiveError naming the archive."""

    def __init__(self, archive: Path):
        self.archive = archive

    def __enter__(self) -> None:
        return None

    def __exit__(self, tp: type | None, exc: BaseException | None, tb: object) -> Literal[False]:
        if exc is None or isinstance(exc, ArchiveError):
            return False
        if isinstance(exc, FileNotFoundError) and Path(str(exc.filename or "")) == self.archive:
            raise ArchiveError(f"{self.archive}: no such file") from exc
        if isinstance(exc, FileExistsError):
            raise ArchiveError(f"{self.archive}: a member appears twice ({exc.filename})") from exc
        if isinstance(exc, (tarfile.TarError, EOFError, OSError, gzip.BadGzipFile, io.UnsupportedOperation, zlib.error)):
            raise ArchiveError(f"{self.archive}: corrupt or truncated archive: {exc}") from exc
        return False


# The standard library's own extraction policy (PEP 706; Python 3.12, and 3.10.12 / 3.11.4 backports): a second
# line of defence under our checks, so a gap in them is still refused by a filter the whole ecosystem reviews.
_DATA_FILTER = getattr(tarfile, "data_filter", None)
_NO_DEST = "/edge-agent-unpack"  # read_head writes nothing: the filter judges names against a placeholder root


def _second_line(archive: Path, member: tarfile.TarInfo, dest: Path | str) -> None:
    if _DATA_FILTER is None:
        return
    try:
        _DATA_FILTER(member, str(dest))
    except tarfile.FilterError as exc:
        raise ArchiveError(f"{archive}: member {member.name!r} refused by tarfile's data filter: {exc}") from exc


def _members(archive: Path, tar: tarfile.TarFile, limits: UnpackLimits,
             dest: Path | str = _NO_DEST) -> Iterator[tuple[tarfile.TarInfo, PurePosixPath]]:
    """Each member with its safe relative path; refuses links, devices and anything over the limits."""
    count = total = 0
    while True:
        member = tar.next()
        if member is None:
            return
        tar.members = []  # type: ignore[attr-defined]  # tarfile keeps every header it read: a flood must not grow memory
        count += 1
        if count > limits.max_files:
            raise ArchiveError(f"{archive}: more than {limits.max_files} files and directories")
        rel = _safe_name(archive, member.name)
        if member.isdir():
            _second_line(archive, member, dest)
            yield member, rel
            continue
        if member.issym() or member.islnk():
            raise ArchiveError(f"{archive}: member {member.name!r} is a link; bundles hold plain files only")
        if not member.isfile():
            raise ArchiveError(f"{archive}: member {member.name!r} is not a regular file (device, fifo...)")
        if member.size > limits.max_member_bytes:
            raise ArchiveError(
                f"{archive}: member {member.name!r} is {member.size} bytes, over the {limits.max_member_bytes} limit"
            )
        total += member.size
        if total > limits.max_total_bytes:
            raise ArchiveError(f"{archive}: unpacked size over the {limits.max_total_bytes} byte limit")
        _second_line(archive, member, dest)  # after ours, which name the problem more plainly
        yield member, rel


def _extract(archive: Path, work: Path, limits: UnpackLimits, expected: dict[str, str] | None) -> None:
    with _guarded(archive):
        with tarfile.open(archive, mode="r:gz") as tar:
            for member, rel in _members(archive, tar, limits, work):
                if member.isdir():
                    (work / rel).mkdir(parents=True, exist_ok=True)
                    continue
                name = rel.as_posix()
                if expected is not None and name not in expected:
                    raise ArchiveError(f"{archive}: member {name!r} is not listed in the signed {MANIFEST_NAME}")
                target = work / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(member)
                if src is None:
                    raise ArchiveError(f"{archive}: member {member.name!r} has no data")
                written = 0
                digest = hashlib.sha256()
                with open(target, "xb") as out:
                    while chunk := src.read(_CHUNK):
                        written += len(chunk)
                        if written > member.size:
                            raise ArchiveError(f"{archive}: member {member.name!r} is longer than its header says")
                        digest.update(chunk)
                        out.write(chunk)
                if written != member.size:
                    raise ArchiveError(f"{archive}: member {member.name!r} is truncated ({written} of {member.size} bytes)")
                if expected is not None and digest.hexdigest() != expected[name]:
                    raise ArchiveError(f"{archive}: member {name!r}: hash mismatch against the signed {MANIFEST_NAME} "
                                       f"(sha256 {digest.hexdigest()[:16]}..., expected {expected[name][:16]}...)")
