"""Write agent/data/probe.onnx: the tiny model `edge-agent providers` creates a session on.

Conv -> Relu -> GlobalAveragePool -> Flatten -> Gemm -> Softmax: ops every accelerator provider
claims, so a probe that lands on CPU means the provider did not take the graph.
Run once at build time (needs the `build` extra); the output is committed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OUT = Path(__file__).resolve().parents[1] / "agent" / "data" / "probe.onnx"


def build() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.2, "conv_w")
    b = numpy_helper.from_array(np.zeros(8, np.float32), "conv_b")
    fw = numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32) * 0.2, "fc_w")
    fb = numpy_helper.from_array(np.zeros(4, np.float32), "fc_b")
    nodes = [
        helper.make_node("Conv", ["x", "conv_w", "conv_b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["g"], name="fc"),
        helper.make_node("Softmax", ["g"], ["y"], name="softmax", axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "edge_agent_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        initializer=[w, b, fw, fb],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="edge-agent")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(build(), OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
