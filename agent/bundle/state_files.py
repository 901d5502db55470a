"""A state input's initial value as a tensor file in the bundle (`inputs[i].init: <file>.npy`), not a fill.

Some stateful models start from a tensor: a wake-word package's rolling feature buffer starts as the
embeddings of seconds of silence, not zeros. The spec's `init` names a .npy (a path from the spec's folder);
`bundle create` copies it to `states/<input>.npy`, where the manifest's `files` hash it and the signature
covers it like every file. Loading checks its hash, shape and dtype against the declaration before any
window is served; errors name the key and the file. The array travels as `LoadedState.init_value`.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from agent.npio import read_npy
from agent.errors import BundleError
from agent.hashing import sha256_file
from agent.vocabulary.manifest import ExtraInput

STATES_DIR = "states"


@dataclass(frozen=True)
class LoadedState(ExtraInput):
    """A state input whose `init` names a .npy in the bundle, with the array read from it."""

    init_value: Any = field(default=None, compare=False, repr=False)


def with_state_files(spec: dict[str, Any], spec_path: Path | str, root: Path,
                     inputs: tuple[ExtraInput, ...]) -> tuple[ExtraInput, ...]:
    """`bundle create`: each .npy a spec's `init` names copied into the bundle (the spec then names its bundle
    path, which the manifest keeps), and the inputs with the arrays loaded."""
    where = str(spec_path)
    for i, d in enumerate(spec.get("inputs") or []):
        given = d.get("init")
        if not isinstance(given, str):
            continue
        src = Path(spec_path).parent / given
        if not src.is_file():
            raise BundleError(f"{where}: key inputs[{i}].init: {src} is not a file (a .npy, from the spec's folder)")
        rel = f"{STATES_DIR}/{d['name']}.npy"
        (root / STATES_DIR).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, root / rel)
        d["init"] = rel
    moved = tuple(x if not isinstance(x.init, str) else _with(x, init=spec["inputs"][i]["init"])
                  for i, x in enumerate(inputs))
    return load_state_files(root, moved, where)


def load_state_files(root: Path, inputs: tuple[ExtraInput, ...], where: str,
                     files: Mapping[str, str] | None = None) -> tuple[ExtraInput, ...]:
    """`inputs` with each .npy `init` read into a LoadedState; `files` (the manifest's hashes) checked first."""
    out: list[ExtraInput] = []
    for i, x in enumerate(inputs):
        if not isinstance(x.init, str):
            out.append(x)
            continue
        key, rel = f"inputs[{i}].init", x.init
        if x.kind != "state":
            raise BundleError(f"{where}: key {key}: only a state input starts from a file (this one is {x.kind})")
        path = root / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts or not path.is_file():
            raise BundleError(f"{where}: key {key}: {rel} is not a file inside the bundle")
        if files is not None:  # read only what the manifest hashes (verify_files checks every file again)
            if rel not in files:
                raise BundleError(f"{where}: key {key}: {rel} is not listed in the manifest's files (not covered by its hashes)")
            if sha256_file(path) != files[rel]:
                raise BundleError(f"{where}: key {key}: {path}: hash mismatch: the file changed after the bundle was built")
        try:
            value = read_npy(path)
        except (ValueError, OSError) as exc:
            raise BundleError(f"{where}: key {key}: {rel} is not a .npy array ({exc})") from exc
        shape = tuple(int(d) if isinstance(d, int) else -1 for d in x.shape)
        if value.shape != shape:
            raise BundleError(f"{where}: key {key}: {rel} holds shape {list(value.shape)}, the state "
                              f"{x.name!r} is declared {list(x.shape)}")
        if value.dtype != np.dtype(x.dtype):
            raise BundleError(f"{where}: key {key}: {rel} holds {value.dtype}, the state {x.name!r} is declared {x.dtype}")
        out.append(_with(x, init_value=value))
    return tuple(out)


def _with(x: ExtraInput, **changes: Any) -> LoadedState:
    return LoadedState(**{**{f.name: getattr(x, f.name) for f in fields(ExtraInput)}, **changes})
