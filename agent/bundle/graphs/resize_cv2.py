"""cv2.resize INTER_LINEAR of a uint8 image, bit for bit, as ONNX integer arithmetic.

OpenCV's fixed-point bilinear: per axis fx = (float)((d + 0.5) * (1. / (dst / src)) - 0.5), sx = floor(fx),
11-bit weights saturate_cast<short>((1 - f) * 2048) and (f * 2048) (round half to even, as ONNX Round);
the row pass is exact in integers (columns clamped to the image, their weights zeroed at the edges), the column
pass is its vector code: ((R0 >> 4) * b0 >> 16) + ((R1 >> 4) * b1 >> 16) + 2 >> 2 with the source rows
clipped and the weights from the unclipped position, saturated to 0..255. An exact 2x shrink, where cv2
switches to INTER_AREA, gives the same values ((a + b + c + d + 2) >> 2). Build-time only, like the builder.
Shared by the pre recipes (`resize: cv2_exact`) and scripts/ppocr_rec_graphs.py.
"""

from __future__ import annotations

from agent.bundle.graphs.builder import DOUBLE, FLOAT, INT64, Graph

INT32 = "int32"
COEF_BITS = 11  # OpenCV INTER_RESIZE_COEF_BITS


def coefficients(g: Graph, src: str, dst: str, clamp: bool) -> tuple[str, str, str]:
    """cv::resize's source index and fixed-point weights for each destination index along one axis.
    src, dst: int64 [1] sizes. Returns (index int64 [dst], weight0 int64 [dst], weight1 int64 [dst])."""
    src_d, dst_d = g.cast(src, DOUBLE), g.cast(dst, DOUBLE)
    scale = g.op("Div", g.const([1.0], DOUBLE), g.op("Div", dst_d, src_d))  # 1. / inv_scale, in double
    d = g.cast(g.op("Range", g.const(0, INT64), g.squeeze(dst, [0]), g.const(1, INT64)), DOUBLE)
    f = g.cast(g.op("Sub", g.op("Mul", g.op("Add", d, g.const(0.5, DOUBLE)), scale), g.const(0.5, DOUBLE)), FLOAT)
    s = g.op("Floor", f)
    frac = g.op("Sub", f, s)
    idx = g.cast(s, INT64)
    if clamp:  # the row pass: sx < 0 -> (0, fx 0); sx >= W - 1 -> (W - 1, fx 0)
        zero_f = g.const(0.0, FLOAT)
        last = g.op("Sub", src, g.const([1], INT64))
        left = g.op("Less", idx, g.const(0, INT64))
        frac = g.op("Where", left, zero_f, frac)
        idx = g.op("Where", left, g.const(0, INT64), idx)
        right = g.op("GreaterOrEqual", idx, last)
        frac = g.op("Where", right, zero_f, frac)
        idx = g.op("Where", right, last, idx)
    one, coef = g.const(1.0, FLOAT), g.const(float(1 << COEF_BITS), FLOAT)
    w0 = g.cast(g.op("Round", g.op("Mul", g.op("Sub", one, frac), coef)), INT64)
    w1 = g.cast(g.op("Round", g.op("Mul", frac, coef)), INT64)
    return idx, w0, w1


def linear(g: Graph, src: str, h: str, w: str, out_h: str, out_w: str) -> str:
    """src: int32 [H, W, C] levels 0..255; h, w, out_h, out_w: int64 [1]. Returns int32 [out_h, out_w, C]
    (every product fits: 255 * 2048 in the row pass, (522240 >> 4) * 2048 in the column pass)."""
    one = g.const([1], INT64)
    sx, a0, a1 = coefficients(g, w, out_w, clamp=True)
    sx1 = g.op("Min", g.op("Add", sx, g.const(1, INT64)), g.op("Sub", w, one))
    col = g.const([0, 2], INT64)
    a0, a1 = g.cast(a0, INT32), g.cast(a1, INT32)
    rows = g.op("Add", g.op("Mul", g.gather(src, sx, axis=1), g.op("Unsqueeze", a0, col)),
                g.op("Mul", g.gather(src, sx1, axis=1), g.op("Unsqueeze", a1, col)))
    sy, b0, b1 = coefficients(g, h, out_h, clamp=False)
    b0, b1 = g.cast(b0, INT32), g.cast(b1, INT32)
    zero = g.const(0, INT64)
    last_row = g.squeeze(g.op("Sub", h, one), [0])
    y0 = g.op("Clip", sy, zero, last_row)
    y1 = g.op("Clip", g.op("Add", sy, g.const(1, INT64)), zero, last_row)
    row = g.const([1, 2], INT64)
    k16, k65536, k4, k2 = (g.const(v, INT32) for v in (16, 65536, 4, 2))  # every term is >= 0: Div floors

    def term(r: str, b: str) -> str:
        return g.op("Div", g.op("Mul", g.op("Div", g.gather(rows, r, axis=0), k16), g.op("Unsqueeze", b, row)), k65536)

    pix = g.op("Div", g.op("Add", g.op("Add", term(y0, b0), term(y1, b1)), k2), k4)
    return g.op("Clip", pix, g.const(0, INT32), g.const(255, INT32))
