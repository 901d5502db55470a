"""The manifest's cross-key rules a JSON Schema cannot say: variants, inputs and their states, decisions, the
resize, the stage graphs and the result block; each refusal names its key."""

from __future__ import annotations

from typing import Mapping


from agent.errors import BundleError
from agent.vocabulary.result_spec import check_result

from agent.vocabulary.manifest import (MAX_RAW_VALUES, Manifest, PostprocessSpec,
                                 ResizeSpec, TensorSpec)


def check_batch_axes(outputs: tuple[TensorSpec, ...], where: str) -> None:
    """An output's declared batch axis must be one of its axes."""
    for i, o in enumerate(outputs):
        if not 0 <= o.batch_axis < max(len(o.shape), 1):
            raise BundleError(f"{where}: key outputs[{i}].batch_axis: {o.batch_axis} is not an axis of output "
                              f"{o.name!r} (shape {list(o.shape)})")


def check_semantics(m: Manifest, where: str) -> None:
    """Cross-key rules a JSON Schema cannot say."""
    names = [v.name for v in m.variants]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise BundleError(f"{where}: key variants: duplicate variant names {sorted(dupes)}")
    for i, v in enumerate(m.variants):
        if v.file not in m.files:
            raise BundleError(f"{where}: key variants[{i}].file: {v.file!r} is not listed in files")
        own = [(o.name, o.dtype, len(o.shape)) for o in v.outputs]
        if own and own != [(o.name, o.dtype, len(o.shape)) for o in m.outputs]:
            raise BundleError(f"{where}: key variants[{i}].outputs: a variant's own contract differs from outputs in "
                              f"dims only; found {[(n, d) for n, d, _ in own]} (rank {[r for *_, r in own]}), outputs "
                              f"{[(o.name, o.dtype) for o in m.outputs]}")
    for provider, prefs in m.preference.items():
        for n in prefs:
            if n not in names:
                raise BundleError(f"{where}: key preference.{provider}: unknown variant {n!r} (variants: {names})")
    for i, g in enumerate(m.golden):
        if g not in m.files:
            raise BundleError(f"{where}: key golden[{i}]: {g!r} is not listed in files")
    for key, ref in (("postprocess.labels", m.postprocess.labels), ("preprocess.graph", m.preprocess.graph),
                     ("postprocess.graph", m.postprocess.graph),
                     ("postprocess.result.charset", m.postprocess.result.charset if m.postprocess.result else None)):
        if ref is not None and ref not in m.files:
            raise BundleError(f"{where}: key {key}: {ref!r} is not listed in files (every stage file is hashed and signed)")
    check_stages(m, where)
    for rel in m.files:
        if rel.startswith("/") or ".." in rel.split("/") or rel in ("bundle.yaml", "bundle.sig"):
            raise BundleError(f"{where}: key files: {rel!r} is not a plain relative path inside the bundle")
    pre, frame = m.preprocess, m.frame
    outs = set(m.output_names)
    for key, ref in (("output", m.postprocess.output), ("boxes_output", m.postprocess.boxes_output),
                     ("scores_output", m.postprocess.scores_output)):
        if ref is not None and ref not in outs:
            raise BundleError(f"{where}: key postprocess.{key}: {ref!r} is not a declared output {sorted(outs)}")
    for key, ref in (("outputs", n) for n in m.postprocess.outputs):
        if ref not in outs:
            raise BundleError(f"{where}: key postprocess.{key}: {ref!r} is not a declared output {sorted(outs)}")
    check_postprocess_keys(m.postprocess, where)
    check_decisions(m, where)
    check_batch_axes(m.outputs, where)
    if m.postprocess.stage_channel_axis == 0:
        raise BundleError(f"{where}: key postprocess.channel_axis: 0 is the batch axis; channels are on axis 1 or "
                          "later (-1: the last)")
    if m.postprocess.type == "raw" and m.postprocess.channel_axis == 0:
        raise BundleError(f"{where}: key postprocess.channel_axis: 0 is the batch axis; channels are on axis 1 or "
                          "later (-1: the last)")
    check_inputs(m, where)
    if pre_resize_problem := resize_problem(m.preprocess.resize):
        raise BundleError(f"{where}: key preprocess.resize: {pre_resize_problem}")
    if pre.graph is not None and frame.kind == "image":
        return  # the graph makes the model's tensor: check_stages refused the vocabulary's keys beside it
    if frame.kind == "image":
        if pre.layout not in ("nchw", "nhwc"):
            raise BundleError(f"{where}: key preprocess.layout: image frames need nchw or nhwc, found {pre.layout!r}")
        channels = 1 if (pre.color or frame.color) == "gray" else 3
    else:
        if pre.graph is None and pre.layout not in ("ncw", "nwc", "nw"):
            raise BundleError(f"{where}: key preprocess.layout: sensor frames need ncw, nwc or nw, found {pre.layout!r}")
        if pre.graph is None and pre.layout == "nw" and frame.channels != 1:
            raise BundleError(f"{where}: key preprocess.layout: nw ([batch, window], no channel axis) needs a "
                              f"one-channel window, the frame has {frame.channels} channels: use ncw or nwc")
        if pre.resize is not None or pre.color is not None:
            raise BundleError(f"{where}: key preprocess: resize and color apply to images, not sensor windows")
        if frame.window < 1:
            raise BundleError(f"{where}: key input.frame.window: a sensor frame needs window (samples) or window_s "
                              "(seconds, with sample_rate)")
        if frame.pad >= frame.window:
            raise BundleError(f"{where}: key input.frame.padding: {frame.pad} samples of padding fill the whole "
                              f"window of {frame.window}: the first window would hold no sample of the stream")
        channels = frame.channels
    if pre.dtype in ("uint8", "int8") and (pre.scale != 1.0 or any(v != 0 for v in pre.mean)
                                            or any(v != 1 for v in pre.std)):
        # the float result would be truncated to integers (1/255 scaling makes every pixel 0)
        raise BundleError(f"{where}: key preprocess.dtype: a {pre.dtype} input takes raw pixels; scale, mean and std "
                          "must be left out (normalise inside the model, or use dtype float32)")
    for key in ("mean", "std"):
        vals = getattr(pre, key)
        if vals and len(vals) not in (1, channels):
            raise BundleError(
                f"{where}: key preprocess.{key}: expected 1 or {channels} values (one per channel), found {len(vals)}"
            )


def resize_problem(r: ResizeSpec | None) -> str | None:
    """What a resize block lacks for its mode, or None when it is complete."""
    if r is None:
        return None
    if r.mode in ("stretch", "letterbox", "short_side_crop") and (r.width < 1 or r.height < 1):
        return f"mode {r.mode} needs width and height (found {r.width}x{r.height})"
    if r.mode == "short_side_crop":
        if r.short_side is None:
            return "mode short_side_crop needs short_side (the short side after resizing, before the crop)"
        if r.short_side < max(r.width, r.height):
            # a frame of either orientation has `short_side` pixels across its short side, so the crop must fit it
            return f"short_side {r.short_side} is smaller than a side of the {r.width}x{r.height} crop"
    if r.mode == "fit_multiple" and (r.limit_side is None or r.multiple < 1):
        return "mode fit_multiple needs limit_side and a multiple >= 1"
    return None


def check_postprocess_keys(p: PostprocessSpec, where: str) -> None:
    if p.type == "detection":
        if p.layout == "boxes_scores" and (p.boxes_output is None or p.scores_output is None):
            raise BundleError(f"{where}: key postprocess: layout boxes_scores needs boxes_output and scores_output")
        if p.layout == "boxes_scores" and p.boxes_output == p.scores_output:
            raise BundleError(
                f"{where}: key postprocess.scores_output: {p.scores_output!r} is also boxes_output; one tensor holding "
                "boxes and scores is a single-tensor layout: set layout: yolov5, yolov8 or end2end and output"
            )
        if p.layout != "boxes_scores" and p.output is None:
            raise BundleError(f"{where}: key postprocess.output: layout {p.layout} needs the name of its output tensor")


def check_inputs(m: Manifest, where: str) -> None:
    outs = set(m.output_names)
    seen = {m.input.name}
    for i, x in enumerate(m.inputs):
        key = f"inputs[{i}]"
        if x.name in seen:
            raise BundleError(f"{where}: key {key}.name: input {x.name!r} is declared twice")
        seen.add(x.name)
        if x.kind == "constant" and x.value is None:
            raise BundleError(f"{where}: key {key}.value: a constant input needs a value")
        if x.kind == "metadata" and x.default is None:
            # fed when a frame carries none: without it a float input got NaN, an integer one a TypeError
            raise BundleError(f"{where}: key {key}.default: a metadata input needs a default (fed when a frame "
                              "carries no value)")
        if x.kind == "state":
            if x.from_output is None:
                raise BundleError(f"{where}: key {key}.from_output: a state input names the output that feeds it")
            if x.from_output not in outs:
                raise BundleError(f"{where}: key {key}.from_output: {x.from_output!r} is not a declared output {sorted(outs)}")
            if not all(isinstance(d, int) for d in x.shape):
                raise BundleError(f"{where}: key {key}.shape: a state's shape must be fixed integers, found {list(x.shape)}")


def check_decisions(m: Manifest, where: str) -> None:
    """The raw decoder's limits, decision and event stage, each refused with its own message."""
    p = m.postprocess
    if p.type != "raw":
        if p.decision is not None or p.events is not None:
            raise BundleError(f"{where}: key postprocess.decision: decisions and events belong to type raw")
        return
    if p.max_values > MAX_RAW_VALUES:
        raise BundleError(f"{where}: key postprocess.max_values: {p.max_values} is over the limit of {MAX_RAW_VALUES} "
                          "values per output (a result carries a summary, never the tensor): publish a decision "
                          "(postprocess.decision) or fewer values")
    d, outs = p.decision, {o.name: o for o in m.outputs}
    if d is not None:
        name = d.output or (p.outputs[0] if p.outputs else m.outputs[0].name)
        if name not in outs:
            raise BundleError(f"{where}: key postprocess.decision.output: {name!r} is not a declared output {sorted(outs)}")
        last = outs[name].shape[-1] if outs[name].shape else 1
        if d.rule == "argmax" and last == 1:
            raise BundleError(f"{where}: key postprocess.decision.rule: argmax over the one value of {name!r} is always "
                              "class 0; a single-output binary model takes rule: threshold")
        if d.rule == "threshold" and isinstance(last, int) and d.channel >= last:
            raise BundleError(f"{where}: key postprocess.decision.channel: {d.channel} is beyond the {last} values of "
                              f"{name!r} {list(outs[name].shape)}")
        if d.rule == "threshold" and d.labels and len(d.labels) != 2:
            raise BundleError(f"{where}: key postprocess.decision.labels: a threshold has two labels [below, at or "
                              f"above], found {len(d.labels)}")
    e = p.events
    if e is not None:
        if d is None:
            raise BundleError(f"{where}: key postprocess.events: an event stage needs postprocess.decision")
        if not m.frame.sample_rate:
            raise BundleError(f"{where}: key postprocess.events: segments are in stream time: the frame needs "
                              "input.frame.sample_rate")
        known = d.labels or (("0", "1") if d.rule == "threshold" else ())
        if known and e.label not in known:
            raise BundleError(f"{where}: key postprocess.events.label: {e.label!r} is not a decision label {list(known)}")
        if e.off_threshold is not None and (d.rule != "threshold" or e.off_threshold > d.threshold):
            raise BundleError(f"{where}: key postprocess.events.off_threshold: hysteresis needs rule threshold and "
                              f"off_threshold <= threshold ({d.threshold})")


PRE_VOCABULARY = ("resize", "color", "scale", "mean", "std", "layout")


def check_stages(m: Manifest, where: str) -> None:
    """Pre and post graphs, the result kind and the outputs used; frame size bounds. Each refused naming its key."""
    pre, post, frame = m.preprocess, m.postprocess, m.frame
    raw_pre = m.raw.get("preprocess", {}) if isinstance(m.raw, Mapping) else {}
    if pre.graph is not None:
        beside = [k for k in PRE_VOCABULARY if k in raw_pre]
        if beside:
            raise BundleError(f"{where}: key preprocess.graph: the graph makes the model's tensor; {beside} beside it "
                              "would be a second preprocessing (put those steps in the graph, or drop the graph)")
        if pre.dtype != m.input.dtype:
            raise BundleError(f"{where}: key preprocess.dtype: {pre.dtype} is not input.dtype {m.input.dtype} (with a "
                              "graph the dtype is the graph's output's)")
        if m.stateful:
            raise BundleError(f"{where}: key preprocess.graph: stateful models take the declarative path")
    if frame.kind == "image" and frame.any_size:
        if pre.graph is None and pre.resize is None:
            raise BundleError(f"{where}: key input.frame: width/height 0 (any size) needs a resize or a "
                              "preprocess.graph to make the model's tensor of each frame")
        if frame.max_size is None:
            raise BundleError(f"{where}: key input.frame.max_size: frames of any size need [height, width] bounds "
                              "(the self-test proves the smallest and the largest)")
        if any(lo > hi for lo, hi in zip(frame.min_size, frame.max_size)):
            raise BundleError(f"{where}: key input.frame.min_size: {list(frame.min_size)} is over max_size "
                              f"{list(frame.max_size)}")
    elif frame.kind == "image" and ("min_size" in m.raw.get("input", {}).get("frame", {})
                                    or "max_size" in m.raw.get("input", {}).get("frame", {})):
        raise BundleError(f"{where}: key input.frame.max_size: size bounds apply to frames of any size (width or "
                          f"height 0); this frame is fixed at {frame.width}x{frame.height}")
    if pre.resize is not None and pre.resize.rounding != "round" and pre.resize.mode != "letterbox":
        raise BundleError(f"{where}: key preprocess.resize.rounding: applies to letterbox; {pre.resize.mode} states "
                          "its own (size_rounding, crop_offset)")
    outs = set(m.output_names)
    for i, name in enumerate(post.uses):
        if name not in outs:
            raise BundleError(f"{where}: key postprocess.uses[{i}]: {name!r} is not a declared output {sorted(outs)}")
    r = post.result
    if post.graph is not None and r is None:
        raise BundleError(f"{where}: key postprocess.result: a post graph needs the result kind it serves and the "
                          "graph output of each field")
    if r is None:
        return
    if post.graph is not None and m.task != r.kind:
        raise BundleError(f"{where}: key task: {m.task!r} is not postprocess.result.kind {r.kind!r} (a bundle with a "
                          "post graph serves its result kind)")
    check_result(r, m.task, post.graph is not None, where)
