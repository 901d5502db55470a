"""Bundles as `.tar.gz`: deterministic packing and an unpacker that trusts nothing in the archive.

Unpacking refuses absolute paths, `..`, links, devices, oversized members and too many files, and
writes into a fresh directory so a refused archive leaves nothing behind.
"""

from __future__ import annotations

import gzip
import io
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from agent.errors import ArchiveError

_CHUNK = 1 << 20


@dataclass(frozen=True)
class UnpackLimits:
    max_member_bytes: int = 512 << 20
    max_total_bytes: int = 2 << 30
    max_files: int = 1000


def pack(src: Path, out: Path) -> Path:
    """Write `src`'s regular files into `out` (.tar.gz), sorted, with zeroed owners and times."""
    src, out = Path(src), Path(out)
    files = sorted(p for p in src.rglob("*") if p.is_file() and not p.is_symlink())
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


def unpack(archive: Path, dest: Path, limits: UnpackLimits = UnpackLimits()) -> Path:
    """Unpack into `dest` (which must not exist). Returns `dest`. Raises ArchiveError, leaving nothing."""
    archive, dest = Path(archive), Path(dest)
    if dest.exists():
        raise ArchiveError(f"{dest}: already exists; unpack into a new directory")
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".unpack-", dir=dest.parent))
    work.chmod(0o755)
    try:
        _extract(archive, work, limits)
        work.rename(dest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return dest


def _extract(archive: Path, work: Path, limits: UnpackLimits) -> None:
    total = count = 0
    try:
        with tarfile.open(archive, mode="r:gz") as tar:
            for member in tar:
                rel = _safe_name(archive, member.name)
                if member.isdir():
                    (work / rel).mkdir(parents=True, exist_ok=True)
                    continue
                if member.issym() or member.islnk():
                    raise ArchiveError(f"{archive}: member {member.name!r} is a link; bundles hold plain files only")
                if not member.isfile():
                    raise ArchiveError(f"{archive}: member {member.name!r} is not a regular file (device, fifo...)")
                count += 1
                if count > limits.max_files:
                    raise ArchiveError(f"{archive}: more than {limits.max_files} files")
                if member.size > limits.max_member_bytes:
                    raise ArchiveError(
                        f"{archive}: member {member.name!r} is {member.size} bytes, over the {limits.max_member_bytes} limit"
                    )
                total += member.size
                if total > limits.max_total_bytes:
                    raise ArchiveError(f"{archive}: unpacked size over the {limits.max_total_bytes} byte limit")
                target = work / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(member)
                if src is None:
                    raise ArchiveError(f"{archive}: member {member.name!r} has no data")
                written = 0
                with open(target, "xb") as out:
                    while chunk := src.read(_CHUNK):
                        written += len(chunk)
                        if written > member.size:
                            raise ArchiveError(f"{archive}: member {member.name!r} is longer than its header says")
                        out.write(chunk)
                if written != member.size:
                    raise ArchiveError(f"{archive}: member {member.name!r} is truncated ({written} of {member.size} bytes)")
    except FileNotFoundError as exc:
        raise ArchiveError(f"{archive}: no such file") from exc
    except FileExistsError as exc:
        raise ArchiveError(f"{archive}: a member appears twice ({exc.filename})") from exc
    except (tarfile.TarError, EOFError, OSError, gzip.BadGzipFile, io.UnsupportedOperation) as exc:
        raise ArchiveError(f"{archive}: corrupt or truncated archive: {exc}") from exc
