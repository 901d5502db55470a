"""The head scan reads the manifest and signature and stops at the first other file: an unsigned or foreign
archive costs one header, not a pass over every member (fault, issue 20: ~15 s of CPU on an unsigned
archive before its refusal, the scan read every member looking for a signature)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from agent.bundle.archive import UnpackLimits, read_head, unpack_signed
from agent.errors import ArchiveError


def _tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_the_head_scan_stops_at_the_first_member_that_is_neither_manifest_nor_signature(tmp_path: Path) -> None:
    # an unsigned archive whose tail is cut off: only a scan that reads past the head meets the damage
    archive = _tar(tmp_path / "u.tar.gz", [("bundle.yaml", b"name: x\n"), ("weights.bin", os.urandom(2 << 20))])
    archive.write_bytes(archive.read_bytes()[: archive.stat().st_size // 2])
    manifest, sig = read_head(archive, UnpackLimits())
    assert manifest == b"name: x\n" and sig is None


def test_a_manifest_after_other_files_is_not_a_bundle(tmp_path: Path) -> None:
    archive = _tar(tmp_path / "late.tar.gz", [("weights.bin", b"w" * 100), ("bundle.yaml", b"name: x\n")])
    assert read_head(archive, UnpackLimits()) == (None, None)
    with pytest.raises(ArchiveError, match="no bundle.yaml"):
        unpack_signed(archive, tmp_path / "out", UnpackLimits(), [], allow_unsigned=True)
