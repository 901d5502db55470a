"""PIL's Image.resize of an 8-bit image (BILINEAR, BICUBIC, LANCZOS), bit for bit, as ONNX integer arithmetic.

Pillow's Resample.c: per axis, scale = src / dst, filterscale = max(scale, 1) (a shrink widens the filter: it
antialiases, where cv2's INTER_LINEAR does not), support = filter support x filterscale; output pixel i takes
source pixels [max(0, int(c - support + 0.5)), min(src, int(c + support + 0.5))) around c = (i + 0.5) * scale,
weights filter((j - c + 0.5) / filterscale) normalised to sum 1, then fixed point: int(w * 2^22 +- 0.5).
Horizontal pass first, stored as uint8 (ss = 2^21 + sum(p * k), clip(ss >> 22)), then the vertical pass.
The coefficients are computed in double as Pillow does; the sums are exact in int32, as Pillow's own.
Shared by the pre recipes (`resize: pil`) and post.saliency (`resize: pil`). Build-time only, like the builder.
"""

from __future__ import annotations

import math

from agent.bundle.graphs.builder import DOUBLE, INT64, Graph

INT32 = "int32"
PRECISION_BITS = 32 - 8 - 2  # Pillow's, for 8 bits per channel
SUPPORT = {"linear": 1.0, "cubic": 2.0, "lanczos": 3.0}  # Pillow's filter supports
FILTERS = tuple(SUPPORT)


def _filter(g: Graph, x: str, name: str) -> str:
    """Pillow's filter functions, in double."""
    zero, one = g.const(0.0, DOUBLE), g.const(1.0, DOUBLE)
    if name == "linear":  # bilinear_filter: 1 - |x| inside 1
        ax = g.op("Abs", x)
        return g.op("Where", g.op("Less", ax, one), g.op("Sub", one, ax), zero)
    if name == "cubic":  # bicubic_filter, a = -0.5
        a = -0.5
        ax = g.op("Abs", x)
        near = g.op("Add", g.op("Mul", g.op("Mul", g.op("Sub", g.op("Mul", g.const(a + 2.0, DOUBLE), ax),
                                                           g.const(a + 3.0, DOUBLE)), ax), ax), one)
        far = g.op("Mul", g.op("Sub", g.op("Mul", g.op("Add", g.op("Mul", g.op("Sub", ax, g.const(5.0, DOUBLE)), ax),
                                                          g.const(8.0, DOUBLE)), ax), g.const(4.0, DOUBLE)),
                   g.const(a, DOUBLE))
        two = g.const(2.0, DOUBLE)
        return g.op("Where", g.op("Less", ax, one), near, g.op("Where", g.op("Less", ax, two), far, zero))

    def sinc(v: str) -> str:  # sinc_filter: 1 at 0, else sin(pi x) / (pi x)
        px = g.op("Mul", v, g.const(math.pi, DOUBLE))
        return g.op("Where", g.op("Equal", v, zero), one, g.op("Div", g.op("Sin", px), px))

    three = g.const(3.0, DOUBLE)
    inside = g.op("And", g.op("GreaterOrEqual", x, g.const(-3.0, DOUBLE)), g.op("Less", x, three))
    return g.op("Where", inside, g.op("Mul", sinc(x), sinc(g.op("Div", x, three))), zero)


def coefficients(g: Graph, src: str, dst: str, name: str) -> tuple[str, str, str]:
    """Pillow's precompute_coeffs + normalize_coeffs_8bpc along one axis. src, dst: int64 [1].
    Returns (source indices int64 [dst * ksize], fixed-point weights int32 [dst, ksize], ksize int64 [1]);
    taps past a pixel's window have weight 0 (their index clamped into the image)."""
    src_d, dst_d = g.cast(src, DOUBLE), g.cast(dst, DOUBLE)
    one = g.const(1.0, DOUBLE)
    scale = g.op("Div", src_d, dst_d)
    fscale = g.op("Max", scale, one)
    support = g.op("Mul", g.const(SUPPORT[name], DOUBLE), fscale)
    ksize = g.op("Add", g.op("Mul", g.cast(g.op("Ceil", support), INT64), g.const([2], INT64)), g.const([1], INT64))
    half = g.const(0.5, DOUBLE)
    i = g.cast(g.op("Range", g.const(0, INT64), g.squeeze(dst, [0]), g.const(1, INT64)), DOUBLE)
    center = g.op("Mul", g.op("Add", i, half), scale)  # [dst]
    # int() of a negative start truncates towards 0, where Pillow then clamps to 0 anyway: floor is the same
    xmin = g.op("Max", g.op("Floor", g.op("Add", g.op("Sub", center, support), half)), g.const(0.0, DOUBLE))
    xend = g.op("Min", g.op("Floor", g.op("Add", g.op("Add", center, support), half)), src_d)
    t = g.cast(g.op("Range", g.const(0, INT64), g.squeeze(ksize, [0]), g.const(1, INT64)), DOUBLE)
    j = g.op("Add", g.unsqueeze(xmin, [1]), g.unsqueeze(t, [0]))  # [dst, ksize]
    inside = g.op("Less", j, g.unsqueeze(xend, [1]))
    ss = g.op("Div", one, fscale)
    w = _filter(g, g.op("Mul", g.op("Add", g.op("Sub", j, g.unsqueeze(center, [1])), half), ss), name)
    w = g.op("Where", inside, w, g.const(0.0, DOUBLE))
    ww = g.op("ReduceSum", w, g.const([1], INT64), keepdims=1)
    w = g.op("Where", g.op("Equal", ww, g.const(0.0, DOUBLE)), w, g.op("Div", w, ww))
    v = g.op("Mul", w, g.const(float(1 << PRECISION_BITS), DOUBLE))
    k = g.op("Where", g.op("Less", w, g.const(0.0, DOUBLE)), g.op("Neg", g.op("Floor", g.op("Sub", half, v))),
             g.op("Floor", g.op("Add", v, half)))
    idx = g.op("Min", g.cast(j, INT64), g.op("Sub", src, g.const([1], INT64)))
    return g.reshape(idx, [-1]), g.cast(k, INT32), ksize


def _pass(g: Graph, x: str, src: str, dst: str, name: str) -> str:
    """One 8-bit pass along axis 0 of int32 levels [src, M, C] -> [dst, M, C]: gathers whole rows (contiguous
    copies; a Gather along an inner axis is element by element), weights them, sums, shifts, clips."""
    idx, k, ksize = coefficients(g, src, dst, name)
    rows = g.gather(x, idx, axis=0)  # [dst * ksize, M, C]
    rest = g.slice(g.op("Shape", x), [1], [3], [0])
    rows = g.reshape(rows, g.concat([dst, ksize, rest], 0))
    acc = g.op("ReduceSum", g.op("Mul", rows, g.unsqueeze(k, [2, 3])), g.const([1], INT64), keepdims=0)
    rounded = g.op("Add", acc, g.const(1 << (PRECISION_BITS - 1), INT32))
    # Pillow shifts right (floor); Div truncates towards 0: they differ only below 0, which clips to 0 either way
    return g.op("Clip", g.op("Div", rounded, g.const(1 << PRECISION_BITS, INT32)), g.const(0, INT32),
                g.const(255, INT32))


def resize(g: Graph, src: str, h: str, w: str, out_h: str, out_w: str, name: str) -> str:
    """src: int32 [H, W, C] levels 0..255; h, w, out_h, out_w: int64 [1]. Returns int32 [out_h, out_w, C]:
    Image.resize((out_w, out_h), filter) of the same uint8 image. The pass order is Pillow's as measured
    (Pillow 13.0): horizontal first, except where the height shrinks by a smaller factor than the width
    (out_h / h < out_w / w, out_h < h: vertical first). That rule is fitted, not read from Pillow's source: it
    holds on every size pair measured where an axis grows, and on 39 of 42 where both shrink; the other 3
    differ by a few levels on some pixels. Along an axis whose size does not change
    the weights are the identity (every other tap at a whole-pixel zero of the filter, weight 0 in fixed
    point), the levels Pillow's skipped pass leaves."""
    def transposed(x: str) -> str:
        return g.op("Transpose", x, perm=[1, 0, 2])

    h_first = _pass(g, transposed(_pass(g, transposed(src), w, out_w, name)), h, out_h, name)
    v_first = transposed(_pass(g, transposed(_pass(g, src, h, out_h, name)), w, out_w, name))
    # the height shrinks, and by a smaller factor than the width: out_h / h < out_w / w, in integers
    vertical_first = g.op("And", g.op("Less", out_h, h), g.op("Less", g.op("Mul", out_h, w), g.op("Mul", out_w, h)))
    return g.op("Where", g.unsqueeze(vertical_first, [1, 2]), v_first, h_first)
