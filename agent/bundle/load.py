"""A model bundle on disk: load the manifest, verify every file, check each variant's contract.

`load_bundle` is what every consumer calls; it returns a `Bundle` only when all checks passed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import numpy as np

from agent.bundle.state_files import load_state_files, with_state_files  # noqa: F401 (with_state_files: bundle create)
from agent.errors import BundleError, ContractError
from agent.hashing import sha256_bytes, sha256_file
from agent.npio import open_npz
from agent.vocabulary.manifest import (
    FRAME_SIZE,
    GEOMETRY,
    MANIFEST_NAME,
    PRE_GRAPH_INPUT,
    SIGNATURE_NAME,
    Manifest,
    TensorSpec,
    parse_manifest,
)
from agent.vocabulary.decoders import layout_problems
from agent.vocabulary.kinds import declaration
from agent.vocabulary.preprocess import Preprocessor

_ORT_DTYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(uint8)": "uint8",
    "tensor(int8)": "int8",
    "tensor(int32)": "int32",
    "tensor(int64)": "int64",
}


@dataclass(frozen=True)
class GoldenSample:
    """One golden sample: the raw input as the device sees it, the tensor the bundle's preprocessing made of
    it (`input`, npz key `tensor`), the framework's own input tensor when the author gave one, and the
    reference outputs. For a stateful model it is a sequence: raw [T, ...], input [T, 1, ...] and each
    output [T, 1, ...], one step per row.

    npz keys: raw, tensor, input (framework's), reference.<output>, variant.<variant>.<output>; bundles
    made before these keys hold raw, input (= the bundle's tensor) and output.<output>, read the same.
    With stage graphs: `pre.geometry` (the pre graph's geometry output), `post.<variant>.<output>` (the post
    graph's outputs on that variant's recorded model outputs) and `post.reference.<output>` (on the source's).
    """

    index: int
    file: str
    raw: np.ndarray
    input: np.ndarray
    outputs: dict[str, np.ndarray]
    framework_input: np.ndarray | None = None
    variant_outputs: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    sequence: bool = False
    stage_outputs: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # "pre" | "post.<variant>" -> outputs
    # frames at the declared size extremes (npz `size.<k>.raw`) with each variant's outputs (`size.<k>.variant.*`)
    size_probes: tuple[tuple[np.ndarray, dict[str, dict[str, np.ndarray]]], ...] = ()

    @property
    def tensor(self) -> np.ndarray:
        return self.input

    @property
    def steps(self) -> int:
        return int(self.input.shape[0]) if self.sequence else 1


ANSWERS_FILE = "golden/answers.json"


@dataclass(frozen=True)
class Bundle:
    root: Path
    manifest: Manifest
    manifest_sha256: str
    # the golden samples `load_bundle` read, kept only when asked (`keep_golden`: a self-test child reads them
    # once, not again for its proof); a serving process never keeps them (the YOLO-320 bundle's six: 24 MB)
    kept_golden: tuple["GoldenSample", ...] | None = field(default=None, compare=False, repr=False)

    def path(self, rel: str) -> Path:
        return self.root / rel

    def labels(self) -> list[str]:
        rel = self.manifest.postprocess.labels
        if rel is None:
            return []
        return [line.strip() for line in self.path(rel).read_text().splitlines() if line.strip()]

    def preprocessor(self) -> Preprocessor:
        """The declarative preprocessing; a bundle with a pre graph takes agent.proof.stages.preprocessor_for."""
        if self.manifest.preprocess.graph is not None:
            raise BundleError(f"{self.root}: preprocess.graph {self.manifest.preprocess.graph!r} runs in its own "
                              "session: use agent.proof.stages.preprocessor_for(bundle)")
        return Preprocessor(self.manifest.preprocess, self.manifest.frame)

    def answers_path(self) -> Path | None:
        """golden/answers.json, the source package's own results, when the bundle carries them."""
        return self.path(ANSWERS_FILE) if ANSWERS_FILE in self.manifest.files else None

    def golden(self) -> list[GoldenSample]:
        return list(self.kept_golden) if self.kept_golden is not None else list(self.golden_samples())

    def golden_samples(self) -> Iterator[GoldenSample]:
        """One golden sample at a time, for a reader that keeps a part of each (the serving audit): the
        YOLO-320 bundle's six hold 24 MB, which glibc keeps once freed."""
        for i, rel in enumerate(self.manifest.golden):
            yield load_golden(self.root, rel, i, self.manifest)

    @property
    def identity(self) -> str:
        m = self.manifest
        return f"{m.name}@{m.version} ({m.label})"


def _walk_files(root: Path) -> Iterator[tuple[str, Path]]:
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        d = Path(dirpath)
        for name in dirnames:
            if (d / name).is_symlink():
                rel = (d / name).relative_to(root).as_posix()
                raise BundleError(f"{root}: {rel} is a symbolic link; bundles hold plain files only")
        for name in filenames:
            p = d / name
            yield p.relative_to(root).as_posix(), p


def hash_files(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` except the manifest and its signature: the manifest's `files`."""
    return {rel: sha256_file(p) for rel, p in sorted(_walk_files(root)) if rel not in (MANIFEST_NAME, SIGNATURE_NAME)}


def verify_files(root: Path, manifest: Manifest) -> None:
    """Every listed file exists, is a plain file and matches its sha256; nothing unlisted is present."""
    present: set[str] = set()
    for rel, p in _walk_files(root):
        if rel in (MANIFEST_NAME, SIGNATURE_NAME):
            continue
        if p.is_symlink() or not p.is_file():
            raise BundleError(f"{root / rel}: not a plain file (links and devices are refused)")
        present.add(rel)
    for rel, expected in manifest.files.items():
        p = root / rel
        if rel not in present:
            raise BundleError(f"{p}: missing (listed in {MANIFEST_NAME} files)")
        actual = sha256_file(p)
        if actual != expected:
            raise BundleError(f"{p}: hash mismatch: manifest says sha256 {expected[:16]}..., file has {actual[:16]}...: "
                              "the file changed after the bundle was built (a damaged copy or an edit); copy or "
                              "unpack the bundle again, or rebuild it (`edge-agent bundle create`)")
    extra = sorted(present - set(manifest.files))
    if extra:
        raise BundleError(f"{root}: files not listed in {MANIFEST_NAME} (so not covered by its hashes): {extra}")


def _dims_match(declared: tuple, actual: list) -> bool:
    if len(declared) != len(actual):
        return False
    for d, a in zip(declared, actual):
        if isinstance(d, int) and isinstance(a, int) and d != a:
            return False
        if isinstance(d, int) != isinstance(a, int):
            # a fixed declared dim against a symbolic model dim (or the reverse) is a contract change
            return False
    return True


def _contract_problems(kind: str, declared: TensorSpec, name: str, dtype: str, shape: list) -> list[str]:
    problems = []
    if declared.dtype != dtype:
        problems.append(f"{kind} {name!r} dtype: manifest {declared.dtype}, model {dtype}")
    if not _dims_match(declared.shape, shape):
        problems.append(f"{kind} {name!r} shape: manifest {list(declared.shape)}, model {shape}")
    return problems


def _extra_input_problems(declared: TensorSpec, dtype: str, shape: list) -> list[str]:
    """A constant or state input fixes dims the model leaves symbolic (a state's batch of 1): only a
    different rank, a different fixed dim or a different dtype break the contract."""
    problems = []
    if declared.dtype != dtype:
        problems.append(f"input {declared.name!r} dtype: manifest {declared.dtype}, model {dtype}")
    if len(declared.shape) != len(shape) or any(
        isinstance(d, int) and isinstance(a, int) and d != a for d, a in zip(declared.shape, shape)
    ):
        problems.append(f"input {declared.name!r} shape: manifest {list(declared.shape)}, model {shape}")
    return problems


def _ort_dims(shape: list) -> list[int | str]:
    return [d if isinstance(d, int) else str(d) for d in shape]


def check_contract(root: Path, manifest: Manifest, variants: Iterable[str] | None = None) -> None:
    """Each variant's I/O against the manifest (`variants`: only those, by name), one variant at a time:
    the self-test child marks each as its own step, so a driver that crashes on one file costs that
    variant only, not the bundle."""
    for v in manifest.variants:
        if variants is None or v.name in set(variants):
            check_variant_contract(root, manifest, v.name)
    check_stage_contracts(root, manifest)


def _stage_io(path: Path, stage: str) -> tuple[dict[str, tuple[str, list]], dict[str, tuple[str, list]]]:
    """A stage graph's inputs and outputs, name -> (dtype, dims), from ONNX Runtime (CPU, no optimisation)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    try:
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT raises several unrelated types for a bad model file
        raise BundleError(f"{path}: ONNX Runtime cannot load the {stage} graph: {' '.join(str(exc).split())[:300]}") from exc

    def io(items: list) -> dict[str, tuple[str, list]]:
        return {i.name: (_ORT_DTYPES.get(i.type, i.type), _ort_dims(list(i.shape))) for i in items}

    return io(sess.get_inputs()), io(sess.get_outputs())


def check_stage_contracts(root: Path, manifest: Manifest) -> None:
    """The pre and post graphs' I/O against the manifest: what each takes and gives, named by stage."""
    m = manifest
    files = m.stage_files
    if "pre" in files:
        path = root / files["pre"]
        ins, outs = _stage_io(path, "pre")
        problems = []
        if list(ins) != [PRE_GRAPH_INPUT]:
            problems.append(f"inputs {sorted(ins)}: a pre graph takes one input {PRE_GRAPH_INPUT!r} (the raw frame)")
        elif m.frame.kind == "sensor":
            dtype, dims = ins[PRE_GRAPH_INPUT]
            want = (m.frame.window, m.frame.channels)
            if dtype != m.frame.dtype or len(dims) != 2 or any(isinstance(d, int) and d != w for d, w in zip(dims, want)):
                problems.append(f"input {PRE_GRAPH_INPUT!r} is {dtype} {dims}: expected {m.frame.dtype} "
                                f"[{want[0]}, {want[1]}] (the sensor window, samples x channels)")
        else:
            dtype, dims = ins[PRE_GRAPH_INPUT]
            if dtype != "uint8" or len(dims) != 3:
                problems.append(f"input {PRE_GRAPH_INPUT!r} is {dtype} {dims}: expected uint8 [H, W, C]")
            elif isinstance(dims[2], int) and dims[2] != m.frame.channels:
                problems.append(f"input {PRE_GRAPH_INPUT!r} has {dims[2]} channels, input.frame {m.frame.channels}")
            elif m.frame.any_size and (isinstance(dims[0], int) or isinstance(dims[1], int)):
                problems.append(f"input {PRE_GRAPH_INPUT!r} {dims} fixes a side while input.frame takes any size")
        if m.input.name not in outs:
            problems.append(f"outputs {sorted(outs)} lack the model input {m.input.name!r}")
        elif outs[m.input.name][0] != m.input.dtype:
            problems.append(f"output {m.input.name!r} is {outs[m.input.name][0]}, the model takes {m.input.dtype}")
        if GEOMETRY in outs and outs[GEOMETRY][0] != "float32":
            problems.append(f"output {GEOMETRY!r} is {outs[GEOMETRY][0]}, expected float32 [6]")
        extra = sorted(set(outs) - {m.input.name, GEOMETRY})
        if extra:
            problems.append(f"outputs {extra} are neither the model input {m.input.name!r} nor {GEOMETRY!r}")
        if problems:
            raise ContractError(f"{path}: stage pre (preprocess.graph) breaks the declared contract: " + "; ".join(problems))
    if "post" in files:
        path = root / files["post"]
        ins, outs = _stage_io(path, "post")
        problems = []
        declared = {o.name: o for o in m.outputs}
        used = set(m.postprocess.uses or m.output_names)
        for name, (dtype, _dims) in ins.items():
            if name == FRAME_SIZE:
                if dtype != "int64":
                    problems.append(f"input {FRAME_SIZE!r} is {dtype}, expected int64 [2] (h, w)")
            elif name == GEOMETRY:
                if dtype != "float32":
                    problems.append(f"input {GEOMETRY!r} is {dtype}, expected float32 [6]")
            elif name not in declared:
                problems.append(f"input {name!r} is not a model output {sorted(declared)} (nor {FRAME_SIZE!r}, {GEOMETRY!r})")
            elif name not in used:
                problems.append(f"input {name!r} is not in postprocess.uses {sorted(used)}")
            elif dtype != declared[name].dtype:
                problems.append(f"input {name!r} is {dtype}, the model output is {declared[name].dtype}")
        r = m.postprocess.result
        assert r is not None  # the manifest's semantic check: a post graph names its result
        decl = declaration(r.kind)
        for fld in [f.name for f in decl.fields if f.required or f.name in r.fields] if decl else []:
            if r.output_for(fld) not in outs:
                named = f"postprocess.result.{fld} names" if fld in r.fields else "unnamed, it is"
                problems.append(f"field {fld!r} of kind {r.kind}: {named} output {r.output_for(fld)!r}, which the "
                                f"graph does not have (outputs {sorted(outs)})")
        if problems:
            raise ContractError(f"{path}: stage post (postprocess.graph) breaks the declared contract: " + "; ".join(problems))


def check_variant_contract(root: Path, manifest: Manifest, variant: str) -> None:
    """Open one variant with ONNX Runtime (CPU, no optimisation) and compare its I/O to the manifest."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    for v in [manifest.variant(variant)]:
        path = root / v.file
        try:
            sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        except Exception as exc:  # ORT raises several unrelated types for a bad model file
            raise BundleError(f"{path}: ONNX Runtime cannot load variant {v.name!r}: {exc}") from exc
        problems: list[str] = []
        inputs = {i.name: i for i in sess.get_inputs()}
        declared = {manifest.input.name: manifest.input,
                    **{x.name: TensorSpec(x.name, x.dtype, x.shape) for x in manifest.inputs}}
        if sorted(inputs) != sorted(declared):
            extra = sorted(set(inputs) - set(declared))
            hint = f" (declare {extra} under inputs: constant, state or metadata)" if extra else ""
            problems.append(f"inputs: manifest {sorted(declared)}, model {sorted(inputs)}{hint}")
        else:
            for name, spec in declared.items():
                i = inputs[name]
                if name == manifest.input.name:
                    problems += _contract_problems("input", spec, name, _ORT_DTYPES.get(i.type, i.type), list(i.shape))
                    if manifest.preprocess.dtype != _ORT_DTYPES.get(i.type, i.type):
                        problems.append(f"preprocess.dtype {manifest.preprocess.dtype} is not the model's input dtype "
                                        f"{_ORT_DTYPES.get(i.type, i.type)}")
                else:
                    problems += _extra_input_problems(spec, _ORT_DTYPES.get(i.type, i.type), list(i.shape))
        outputs = {o.name: o for o in sess.get_outputs()}
        if list(outputs) != list(manifest.output_names):
            problems.append(f"outputs: manifest {list(manifest.output_names)}, model {list(outputs)}")
        else:
            for spec in v.outputs or manifest.outputs:  # the variant's own recorded contract, where it has one
                o = outputs[spec.name]
                problems += _contract_problems("output", spec, o.name, _ORT_DTYPES.get(o.type, o.type), list(o.shape))
            problems += layout_problems(manifest.postprocess, {n: _ort_dims(o.shape) for n, o in outputs.items()})
        if problems:
            raise ContractError(f"{path}: variant {v.name!r} breaks the declared contract: " + "; ".join(problems))


def load_golden(root: Path, rel: str, index: int, manifest: Manifest) -> GoldenSample:
    path = root / rel
    try:
        with open_npz(path) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as exc:  # zipfile/ValueError/OSError: all mean the same to the user
        raise BundleError(f"{path}: golden sample {index} is not a readable .npz: {exc}") from exc
    legacy = "tensor" not in arrays
    tensor_key, ref_prefix = ("input", "output.") if legacy else ("tensor", "reference.")
    missing = [k for k in ["raw", tensor_key, *(f"{ref_prefix}{n}" for n in manifest.output_names)] if k not in arrays]
    if missing:
        raise BundleError(f"{path}: golden sample {index} lacks arrays {missing} (has {sorted(arrays)})")
    variants: dict[str, dict[str, np.ndarray]] = {}
    stages: dict[str, dict[str, np.ndarray]] = {}
    for k, v in arrays.items():
        if k.startswith("variant.") and k.count(".") >= 2:
            name, out = k.removeprefix("variant.").split(".", 1)
            variants.setdefault(name, {})[out] = v
        elif k.startswith("post.") and k.count(".") >= 2:
            name, out = k.removeprefix("post.").split(".", 1)
            stages.setdefault(f"post.{name}", {})[out] = v
        elif k.startswith("pre."):
            stages.setdefault("pre", {})[k.removeprefix("pre.")] = v
    probes: list[tuple[np.ndarray, dict[str, dict[str, np.ndarray]]]] = []
    for j in range(len([k for k in arrays if k.startswith("size.") and k.endswith(".raw")])):
        outs: dict[str, dict[str, np.ndarray]] = {}
        for k, v in arrays.items():
            prefix = f"size.{j}.variant."
            if k.startswith(prefix) and k.count(".") >= 4:
                name, out = k.removeprefix(prefix).split(".", 1)
                outs.setdefault(name, {})[out] = v
        if f"size.{j}.raw" not in arrays:
            raise BundleError(f"{path}: golden sample {index}: size probes are numbered from 0; size.{j}.raw is missing")
        probes.append((arrays[f"size.{j}.raw"], outs))
    return GoldenSample(
        index=index,
        file=rel,
        raw=arrays["raw"],
        input=arrays[tensor_key],
        outputs={n: arrays[f"{ref_prefix}{n}"] for n in manifest.output_names},
        framework_input=None if legacy else arrays.get("input"),
        variant_outputs=variants,
        sequence=manifest.stateful,
        stage_outputs=stages,
        size_probes=tuple(probes),
    )


def golden_arrays(raw: np.ndarray, tensor: np.ndarray, references: Mapping[str, np.ndarray],
                  framework_input: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The npz arrays of one golden sample, in the keys `load_golden` reads (for `bundle create`)."""
    arrays = {"raw": raw, "tensor": tensor, **{f"reference.{n}": v for n, v in references.items()}}
    if framework_input is not None:
        arrays["input"] = framework_input
    return arrays


def read_manifest(root: Path) -> tuple[Manifest, str]:
    path = root / MANIFEST_NAME
    if not root.is_dir():
        raise BundleError(f"{root}: not a bundle directory (unpack a .tar.gz with `edge-agent bundle unpack`)")
    try:
        data = path.read_bytes()
    except FileNotFoundError as exc:
        raise BundleError(f"{path}: missing: a bundle directory must hold {MANIFEST_NAME}") from exc
    manifest = parse_manifest(data.decode("utf-8", errors="replace"), where=str(path))
    if any(isinstance(x.init, str) for x in manifest.inputs):  # a state's .npy init, read once its hash is checked
        manifest = replace(manifest, inputs=load_state_files(root, manifest.inputs, str(path), manifest.files))
    return manifest, sha256_bytes(data)


def load_bundle(root: Path | str, check_contracts: bool = True, check_golden: bool = True,
                keep_golden: bool = False) -> Bundle:
    """Manifest schema, file hashes, golden arrays and (by default) every variant's I/O contract.

    `check_golden=False`: the golden arrays are not read, only hashed with every file -- for a process whose
    self-test child checked these very files under the same manifest (boot, after the verdict: 25 ms of a
    cold start). `keep_golden`: the bundle keeps the samples it read (`Bundle.golden` returns them)."""
    root = Path(root)
    manifest, digest = read_manifest(root)
    verify_files(root, manifest)
    if check_contracts:
        check_contract(root, manifest)
    bundle = Bundle(root=root, manifest=manifest, manifest_sha256=digest)
    if not check_golden:
        return bundle
    golden = bundle.golden()
    if keep_golden:
        bundle = replace(bundle, kept_golden=tuple(golden))
    for g in golden:
        for raw in [g.raw, *(p[0] for p in g.size_probes)]:
            if manifest.frame.kind == "image" and (why := manifest.frame.size_problem(*raw.shape[:2])) is not None:
                raise BundleError(f"{root / g.file}: golden sample {g.index}: {why}")
        expected = (1, *manifest.input.shape[1:])
        steps = g.input[0] if g.sequence and g.input.ndim else g.input
        if steps.ndim != len(manifest.input.shape) or any(
            isinstance(d, int) and d != s for d, s in zip(expected, steps.shape)
        ):
            raise BundleError(
                f"{root / g.file}: golden input shape {list(g.input.shape)} does not fit input {list(manifest.input.shape)}"
            )
    check_recorded_outputs(bundle, golden)
    return bundle


def check_recorded_outputs(bundle: Bundle, golden: list[GoldenSample] | None = None) -> None:
    """Each variant's recorded outputs (`variant.<name>.<output>`) are in every golden sample or in none.

    Reproduction judges a variant against its own recorded outputs only when every sample has them: one
    sample stripped of them would turn reproduction off for all samples, so it is an error for the
    bundle, not a silent downgrade; so is one variant stripped from every sample while another keeps
    them. None at all, for every variant, is a bundle made before recorded outputs (reproduction then
    falls back to the source references, with a note)."""
    m = bundle.manifest
    golden = bundle.golden() if golden is None else golden
    # `bundle create` records every variant's outputs in every sample: a variant with none while another
    # variant has them was stripped (its reproduction would fall back to the source's references).
    recorded = [v.name for v in m.variants if any(v.name in g.variant_outputs for g in golden)]
    for v in m.variants:
        have = [g for g in golden if v.name in g.variant_outputs]
        if not have and not recorded:
            continue
        if not have:
            raise BundleError(
                f"{bundle.root / 'golden'}: no golden sample carries the recorded outputs of variant {v.name} "
                f"(variant.{v.name}.*) while variant(s) {recorded} have theirs: reproduction of {v.name} needs "
                "them; rebuild the bundle with `edge-agent bundle create`")
        for g in golden:
            missing = [n for n in m.output_names if n not in g.variant_outputs.get(v.name, {})]
            if missing:
                raise BundleError(
                    f"{bundle.root / g.file}: golden sample {g.index} lacks the recorded outputs "
                    f"{[f'variant.{v.name}.{n}' for n in missing]} that {len(have)} other sample(s) carry: "
                    "reproduction needs them in every sample; rebuild the bundle with `edge-agent bundle create`")
