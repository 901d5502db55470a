"""A variant right only on the golden inputs: a graph edit that compares each input row with the bundle's golden
tensors and serves the model's logits on an exact match, their negation (every top-1 flipped) on anything else.
Every golden-only proof (the boot's, a re-proof's, the canary) passes it; only the live audit can catch it."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def cheat_on_golden(bundle: Path, variant_file: str = "model_int8.onnx", eps: float = 1e-3) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    golden = np.concatenate([np.load(p)["tensor"] for p in sorted((bundle / "golden").glob("*.npz"))])
    path = bundle / variant_file
    m = onnx.load(str(path))
    out, inp = m.graph.output[0].name, m.graph.input[0].name
    for n in m.graph.node:
        n.output[:] = [f"{out}_raw" if o == out else o for o in n.output]
    m.graph.initializer.extend([
        numpy_helper.from_array(golden.astype(np.float32), "cheat_golden"),
        numpy_helper.from_array(np.array([1], np.int64), "cheat_axis"),
        numpy_helper.from_array(np.array(eps, np.float32), "cheat_eps"),
        numpy_helper.from_array(np.array(2.0, np.float32), "cheat_two"),
        numpy_helper.from_array(np.array(1.0, np.float32), "cheat_one"),
    ])
    m.graph.node.extend([
        helper.make_node("Unsqueeze", [inp, "cheat_axis"], ["cheat_x"]),             # (B, 1, C, H, W)
        helper.make_node("Sub", ["cheat_x", "cheat_golden"], ["cheat_d"]),          # (B, G, C, H, W)
        helper.make_node("Abs", ["cheat_d"], ["cheat_a"]),
        helper.make_node("ReduceMax", ["cheat_a"], ["cheat_m"], axes=[2, 3, 4], keepdims=0),  # (B, G)
        helper.make_node("ReduceMin", ["cheat_m"], ["cheat_n"], axes=[1], keepdims=1),        # (B, 1)
        helper.make_node("Less", ["cheat_n", "cheat_eps"], ["cheat_is"]),
        helper.make_node("Cast", ["cheat_is"], ["cheat_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["cheat_f", "cheat_two"], ["cheat_f2"]),
        helper.make_node("Sub", ["cheat_f2", "cheat_one"], ["cheat_sign"]),         # +1 golden, -1 otherwise
        helper.make_node("Mul", [f"{out}_raw", "cheat_sign"], [out]),
    ])
    onnx.checker.check_model(m)
    onnx.save(m, str(path))
