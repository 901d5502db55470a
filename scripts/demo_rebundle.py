"""Rebuild the committed demo bundles with today's `bundle create`, without retraining.

Each bundle's FP32 model (the trained export) and its saved sample sets under calibration/ go through
`bundle create` again, so the bundle carries what today's create records: every variant's outputs on
every golden sample (what reproduction judges), Wilson bounds, the recording environment.
tests/bundle/test_bundle_recorded.py fails when a committed bundle lacks recorded outputs.

Usage: python scripts/demo_rebundle.py [digits-classifier] [vibration-classifier]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_build import ROOT, rebundle  # noqa: E402

DEMOS = {"digits-classifier": "digits", "vibration-classifier": "vibration"}


def main(argv: list[str]) -> int:
    for name in argv or list(DEMOS):
        rebundle(name, ROOT / "calibration" / DEMOS[name], ROOT / "scripts" / "specs" / f"{name}.yaml")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
