"""The graph builder is documented as a supported API (docs/recipes.md, "Writing your own stage"): the example
there runs as written, the graph it makes passes the pre stage's contract, and it computes what Pillow does."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnxruntime as ort

DOC = Path(__file__).resolve().parents[2] / "docs" / "recipes.md"


def test_the_documented_builder_example_runs_and_computes_pillows_resize() -> None:
    from PIL import Image

    text = DOC.read_text()
    section = text[text.index("## Writing your own stage"):text.index("## How they are tested")]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code, "docs/recipes.md: the builder example is gone"
    scope: dict = {}
    exec(compile(code.group(1), "docs/recipes.md", "exec"), scope)  # noqa: S102 -- our own docs' example
    s = ort.InferenceSession(scope["model"].SerializeToString(), providers=["CPUExecutionProvider"])
    assert [i.name for i in s.get_inputs()] == ["frame"] and [o.name for o in s.get_outputs()] == ["images", "geometry"]
    rng = np.random.default_rng(4)
    for h, w in ((100, 70), (31, 90)):
        frame = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        images, geometry = s.run(None, {"frame": frame})
        want = np.asarray(Image.fromarray(frame).resize((48, 48), Image.BICUBIC))[:, :, 1].astype(np.float32) / 255
        assert images.shape == (1, 1, 48, 48)
        assert np.max(np.abs(images[0, 0] - want)) < 1e-6
        assert np.allclose(geometry, [48 / w, 48 / h, 0, 0, 0, 0])
