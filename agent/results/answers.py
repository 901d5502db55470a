"""The package's own answers: the source package's end-to-end results for a sample set, as compact
results of one kind, read from `answers.json` beside a sample directory's frames or key `answers` of an .npz.

Pure apart from reading the file. Every error names the file, the sample index and the field; the number
of results must match the samples. Each result is read by its kind's `normalise` (the kind's compact form
or the vocabulary's result JSON), so a package answer that cannot be judged is refused when it is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from agent.errors import BundleError
from agent.npio import open_npz
from agent.proof.parity import Finding
from agent.results import KINDS, ResultKind

ANSWERS_NAME = "answers.json"  # in a sample directory, and in a bundle as golden/answers.json
NPZ_KEY = "answers"  # in a sample .npz: a 0-d unicode array holding the same JSON
REQUIRED = ("kind", "package", "produced_by", "results")
OPTIONAL = ("notes",)


@dataclass(frozen=True)
class Answers:
    kind: str
    package: str  # e.g. "yolox 0.3.0"
    produced_by: str  # the script or command that ran the package
    results: tuple[Mapping[str, Any], ...]  # one compact result per sample, in sample order
    source: str  # where they were read from, for messages

    @property
    def result_kind(self) -> ResultKind:
        return KINDS[self.kind]

    def document(self) -> dict[str, Any]:
        return {"kind": self.kind, "package": self.package, "produced_by": self.produced_by,
                "results": [dict(r) for r in self.results]}

    def to_json(self) -> str:
        """The answers.json text (strict JSON) that `bundle create` writes into a bundle."""
        return json.dumps(self.document(), indent=1, allow_nan=False, sort_keys=True) + "\n"


def answers_location(samples: Path | str) -> tuple[Path, str | None]:
    """Where a sample set's answers live: (the .npz, its key) or (the directory's answers.json, None)."""
    p = Path(samples)
    if p.suffix == ".npz":
        return p, NPZ_KEY
    if p.is_dir():
        return p / ANSWERS_NAME, None
    return p, None


def has_answers(samples: Path | str) -> bool:
    """Whether a sample set carries the package's answers."""
    path, key = answers_location(samples)
    if key is None:
        return path.is_file()
    if not path.is_file():
        return False
    try:
        with open_npz(path) as z:
            return key in z.files
    except (OSError, ValueError):
        return False


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON (write a non-finite score as null)")


def _parse(text: str, where: str) -> Any:
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except ValueError as exc:
        raise BundleError(f"{where}: the package's answers are not strict JSON: {exc}") from exc


def _load(obj: Any, where: str) -> tuple[Any, str]:
    """(the parsed document, where it was read from) of any form `read_answers` takes."""
    if isinstance(obj, Mapping):
        return obj, where or "package answers"
    if isinstance(obj, np.ndarray):
        return _parse(_array_text(obj, where or f"key {NPZ_KEY}"), where or f"key {NPZ_KEY}"), where
    if isinstance(obj, bytes):
        return _parse(obj.decode("utf-8", errors="replace"), where or "package answers"), where
    if not isinstance(obj, (str, Path)):
        raise BundleError(f"{where}: package answers are a path, a JSON object or an npz array, "
                          f"not {type(obj).__name__}")
    path, key = answers_location(obj)
    label = f"{path} key {key!r}" if key else str(path)
    if key is None:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise BundleError(f"{label}: cannot read the package's answers: {exc}") from exc
        return _parse(text, label), label
    try:
        with open_npz(path) as z:
            if key not in z.files:
                raise BundleError(f"{path}: no key {key!r} with the package's answers (has {z.files})")
            arr = z[key]
    except (OSError, ValueError) as exc:
        raise BundleError(f"{label}: cannot read the package's answers: {exc}") from exc
    return _parse(_array_text(arr, label), label), label


def _array_text(arr: np.ndarray, where: str) -> str:
    if arr.ndim != 0 or arr.dtype.kind not in "US":
        raise BundleError(f"{where}: the answers are a 0-d unicode array holding the JSON text, found "
                          f"{arr.dtype} of shape {list(arr.shape)}")
    v = arr.item()
    return v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v)


def read_answers(obj_or_path: Any, n_samples: int, where: str = "", *, truncate: bool = False) -> Answers:
    """The package's answers for a sample set of `n_samples`, every result read by its kind.

    `obj_or_path`: a sample directory or .npz (their answers are found as above), an answers.json path, a
    parsed document, JSON bytes, or the npz's 0-d array. `where` labels messages when no file names them.
    `truncate`: the sample set was cut to its first `n_samples` (a --limit), so extra answers are dropped;
    fewer answers than samples is always an error."""
    doc, label = _load(obj_or_path, where)
    label = label or where or "package answers"
    if not isinstance(doc, Mapping):
        raise BundleError(f"{label}: the package's answers are a JSON object with {', '.join(REQUIRED)}, "
                          f"found {type(doc).__name__}")
    missing = [k for k in REQUIRED if k not in doc]
    if missing:
        raise BundleError(f"{label}: field {missing[0]}: missing (answers need {', '.join(REQUIRED)})")
    unknown = sorted(set(doc) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise BundleError(f"{label}: field {unknown[0]}: not a field of package answers "
                          f"(known: {', '.join(REQUIRED + OPTIONAL)})")
    kind = doc["kind"]
    if kind not in KINDS:
        raise BundleError(f"{label}: field kind: unknown result kind {kind!r} (known: {', '.join(sorted(KINDS))})")
    for key in ("package", "produced_by"):
        if not isinstance(doc[key], str) or not doc[key].strip():
            raise BundleError(f"{label}: field {key}: a non-empty string wanted (whose answers, made how), "
                              f"found {doc[key]!r}")
    results = doc["results"]
    if not isinstance(results, list):
        raise BundleError(f"{label}: field results: a list of one result per sample wanted, "
                          f"found {type(results).__name__}")
    if len(results) < n_samples or (len(results) > n_samples and not truncate):
        raise BundleError(f"{label}: field results: {len(results)} package answers for {n_samples} samples: "
                          "one per sample, in sample order")
    results = results[:n_samples]
    k = KINDS[kind]
    for i, r in enumerate(results):
        try:
            k.normalise(r)
        except BundleError as exc:
            raise BundleError(f"{label}: sample {i}: {exc}") from exc
    return Answers(kind, doc["package"], doc["produced_by"], tuple(results), label)


def golden_warnings(answers: Answers) -> list[str]:
    """What the kind says this golden set cannot prove (one class only, every mask empty, ...)."""
    return [f"{answers.source}: {w}" for w in answers.result_kind.golden_warnings(answers.results)]


def judge(answers: Answers, served: Sequence[Mapping[str, Any]], floors: Mapping[str, Any] | None = None,
          stage: str = "post") -> tuple[dict[str, Any], list[Finding]]:
    """The served results against these answers by their kind's fidelity. A served result of a type the
    answers' kind cannot read is an error (the bundle serves another kind than the package answers)."""
    return answers.result_kind.fidelity(served, answers.results, floors, stage)
