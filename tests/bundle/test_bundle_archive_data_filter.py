"""tarfile's `data` filter is a second line of defence under the archive's own checks (issue 18): with our first
line switched off, a path traversal is still refused, as an ArchiveError (the filter strips a leading "/" rather
than refusing it, so absolute names stay ours alone)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from agent.bundle import archive
from agent.errors import ArchiveError

pytestmark = pytest.mark.skipif(not hasattr(tarfile, "data_filter"), reason="this Python has no tarfile filters")


def _tar(path: Path, name: str) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(name)
        data = b"x" * 4
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("name, why", [
    ("../../evil", "outside the destination"),
    ("sub/../../../evil", "outside the destination"),
])
def test_the_data_filter_alone_refuses_a_name_our_check_would_refuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   name: str, why: str) -> None:
    # our first line off: the member's name passes through as given (a gap in _safe_name, simulated)
    monkeypatch.setattr(archive, "_safe_name", lambda a, n: Path(n))
    src = _tar(tmp_path / "b.tar.gz", name)
    with pytest.raises(ArchiveError, match=f"refused by tarfile's data filter: .*{why}"):
        archive.unpack(src, tmp_path / "deep" / "out")
    assert not (tmp_path / "deep" / "out").exists() and not list(tmp_path.rglob("evil"))


def test_a_well_formed_bundle_still_unpacks(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2] / "models" / "digits-classifier"
    packed = archive.pack(root, tmp_path / "d.tar.gz")
    out = archive.unpack(packed, tmp_path / "d")
    assert (out / "bundle.yaml").read_bytes() == (root / "bundle.yaml").read_bytes()
