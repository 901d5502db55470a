"""What update tests build before any bundle: a signing key pair and a folder of frames for the tiny bundle."""

from __future__ import annotations

from pathlib import Path


def key_and_frames(d: Path, n: int = 12, seed: int = 9) -> Path:
    """`d/k.pem` and `d/k.pub` (a fresh key pair), and `d/frames` with `n` 40x40 PNG frames: that folder."""
    import cv2

    from agent.bundle.signing import keygen
    from agent.testing import structured_frames

    keygen(d / "k.pem", d / "k.pub")
    frames = d / "frames"
    frames.mkdir()
    for i, f in enumerate(structured_frames(n, 40, seed=seed)):
        cv2.imwrite(str(frames / f"{i:02d}.png"), f)
    return frames
