"""Bundle archives round-trip, and every unsafe or broken archive is refused leaving nothing behind."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from agent.bundle.archive import UnpackLimits, pack, unpack
from agent.bundle.load import load_bundle
from agent.errors import ArchiveError


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return path


def _file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def test_pack_unpack_round_trip_is_byte_identical_and_verifies(tiny_bundle: Path, tmp_path: Path) -> None:
    a = pack(tiny_bundle, tmp_path / "b.tar.gz")
    out = unpack(a, tmp_path / "out")
    load_bundle(out)
    for p in tiny_bundle.rglob("*"):
        if p.is_file():
            assert (out / p.relative_to(tiny_bundle)).read_bytes() == p.read_bytes()
    # deterministic: packing again gives the same bytes
    assert pack(tiny_bundle, tmp_path / "c.tar.gz").read_bytes() == a.read_bytes()


@pytest.mark.parametrize(
    "member, message",
    [
        (_file("../evil.txt"), "path traversal"),
        (_file("a/../../evil.txt"), "path traversal"),
        (_file("/etc/evil"), "absolute path"),
    ],
)
def test_escaping_paths_are_refused(tmp_path: Path, member, message: str) -> None:
    a = _tar(tmp_path / "a.tar.gz", [_file("bundle.yaml"), member])
    with pytest.raises(ArchiveError, match=message):
        unpack(a, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not (tmp_path.parent / "evil.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["a.tar.gz"]


def test_symlink_member_is_refused(tmp_path: Path) -> None:
    link = tarfile.TarInfo("model.onnx")
    link.type = tarfile.SYMTYPE
    link.linkname = "/etc/passwd"
    a = _tar(tmp_path / "a.tar.gz", [(link, None)])
    with pytest.raises(ArchiveError, match="is a link"):
        unpack(a, tmp_path / "out")


def test_hardlink_member_is_refused(tmp_path: Path) -> None:
    link = tarfile.TarInfo("copy")
    link.type = tarfile.LNKTYPE
    link.linkname = "bundle.yaml"
    a = _tar(tmp_path / "a.tar.gz", [_file("bundle.yaml"), (link, None)])
    with pytest.raises(ArchiveError, match="is a link"):
        unpack(a, tmp_path / "out")


def test_device_member_is_refused(tmp_path: Path) -> None:
    dev = tarfile.TarInfo("dev")
    dev.type = tarfile.CHRTYPE
    a = _tar(tmp_path / "a.tar.gz", [(dev, None)])
    with pytest.raises(ArchiveError, match="not a regular file"):
        unpack(a, tmp_path / "out")


def test_oversized_member_is_refused(tmp_path: Path) -> None:
    a = _tar(tmp_path / "a.tar.gz", [_file("big.bin", b"0" * 5000)])
    with pytest.raises(ArchiveError, match=r"'big\.bin' is 5000 bytes, over the 4096 limit"):
        unpack(a, tmp_path / "out", UnpackLimits(max_member_bytes=4096))


def test_too_many_files_is_refused(tmp_path: Path) -> None:
    a = _tar(tmp_path / "a.tar.gz", [_file(f"f{i}") for i in range(6)])
    with pytest.raises(ArchiveError, match="more than 5 files"):
        unpack(a, tmp_path / "out", UnpackLimits(max_files=5))


def test_total_size_bound(tmp_path: Path) -> None:
    a = _tar(tmp_path / "a.tar.gz", [_file(f"f{i}", b"0" * 100) for i in range(5)])
    with pytest.raises(ArchiveError, match="unpacked size"):
        unpack(a, tmp_path / "out", UnpackLimits(max_total_bytes=350))


def test_truncated_archive_is_refused_and_leaves_nothing(tiny_bundle: Path, tmp_path: Path) -> None:
    a = pack(tiny_bundle, tmp_path / "b.tar.gz")
    data = a.read_bytes()
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ArchiveError, match="corrupt or truncated"):
        unpack(cut, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not any(p.name.startswith(".unpack-") for p in tmp_path.iterdir())


def test_not_gzip_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"hello world" * 10)
    with pytest.raises(ArchiveError, match="corrupt or truncated"):
        unpack(bad, tmp_path / "out")


def test_existing_destination_is_not_overwritten(tiny_bundle: Path, tmp_path: Path) -> None:
    a = pack(tiny_bundle, tmp_path / "b.tar.gz")
    (tmp_path / "out").mkdir()
    with pytest.raises(ArchiveError, match="already exists"):
        unpack(a, tmp_path / "out")
