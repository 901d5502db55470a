"""`edge-agent bundle create`: a user's ONNX model -> a verified bundle with FP32 and INT8 variants.

Build-time only (needs the `build` extra: onnx, sympy). Checks the model, records its contract,
proves the spec's preprocessing reproduces the framework's own input tensors (when the samples carry
them), quantizes to static QDQ INT8 calibrated through the bundle's own preprocessing (streamed, in
bounded memory, through sequences for a stateful model), measures quality on a held-out set, writes
golden samples with reference outputs and each variant's own recorded outputs, hashes everything, and
refuses a variant under a fidelity floor (or marks it `below_floor`). Works in a staging directory: a
refusal leaves nothing behind.

This module is the command's shell: the spec read and checked (build_spec.py), the staging directory, the
stage graphs, charset and state files copied in, an audio front-end merged, the model build run
(model_build.py, whose steps call build_runs.py, pre_drift.py, variant_judges.py and quantise.py), the result
loaded as a device would, then published.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from agent.bundle.build_spec import (
    CreateOptions,
    charset_file,
    read_spec,
    stage_files,
    validate_spec_first,
    with_stage_graphs,
)
from agent.bundle.load import load_bundle, with_state_files
from agent.bundle.quantise import need_build_extra, reason_of
from agent.errors import BundleError
from agent.logsetup import get_logger
from agent.vocabulary.manifest import frame_from_dict, inputs_from_list, postprocess_from_dict, preprocess_from_dict
from agent.vocabulary.preprocess import Preprocessor

log = get_logger("bundle.create")  # the build's events keep the command's logger


def create_bundle(opts: CreateOptions) -> Path:
    """Build the bundle at `opts.out` (must not exist). Returns its path."""
    spec = with_stage_graphs(read_spec(opts.spec, pre_graph=opts.pre_graph is not None), opts)
    validate_spec_first(spec, opts)
    out = Path(opts.out)
    if out.exists():
        raise BundleError(f"{out}: already exists; choose a new output directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp makes 0700; a bundle is read by the service's own user
    try:
        _build(spec, opts, staging)
        load_bundle(staging)  # the same checks a device runs, before anything is published
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("bundle.create.done", out=str(out))
    return out


def _build(spec: dict[str, Any], opts: CreateOptions, root: Path) -> None:
    post = postprocess_from_dict(spec["postprocess"])
    task = spec["task"]
    for key, given in (("preprocess.graph", opts.pre_graph), ("postprocess.graph", opts.post_graph)):
        if given is not None:  # copied as given: a stage is never quantised or rewritten
            dest = root / stage_files(spec)[key]
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(given, dest)
    if opts.charset is not None and (rel := charset_file(spec)):  # bytes as given: a space line stays a space
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(opts.charset, root / rel)
    try:  # a state's .npy init is copied into the bundle and loaded
        extra_inputs = with_state_files(spec, opts.spec, root, inputs_from_list(spec.get("inputs")))
    except TypeError as exc:
        raise BundleError(f"{opts.spec}: key inputs: {reason_of(exc)}") from exc
    frame = frame_from_dict(spec["frame"], extra_inputs, str(opts.spec))
    # a pre graph opens once the model's input is known (_build_model); the vocabulary compiles here
    pre = None if opts.pre_graph is not None else Preprocessor(preprocess_from_dict(spec["preprocess"]), frame)
    sequence = any(x.kind == "state" for x in extra_inputs)

    model_path = opts.model
    frontend = None
    if spec.get("frontend"):
        # an audio front-end compiled to ONNX and merged before the model: the bundle takes raw samples
        import onnx

        from agent.bundle.frontends import frontend_from_dict, prepend_frontend

        frontend = frontend_from_dict(spec["frontend"], str(opts.spec))
        need_build_extra()
        model_path = root.parent / f".{root.name}.with-frontend.onnx"
        onnx.save(prepend_frontend(frontend, onnx.load(str(opts.model)), str(opts.spec), extra_inputs), str(model_path))
        log.info("bundle.create.frontend", **frontend.describe())
    try:
        from agent.bundle.model_build import build_model  # its steps use this module's helpers

        build_model(spec, opts, root, model_path, frontend, post, task, extra_inputs, frame, pre, sequence)
    finally:
        if model_path != opts.model:
            model_path.unlink(missing_ok=True)
