"""A state input's initial value as a tensor file in the bundle (`inputs[i].init_file`), not a scalar fill.

Some stateful models start from a tensor: a wake-word package's rolling feature buffer starts as the
embeddings of seconds of silence, not zeros. The spec names a .npy (a path from the spec's folder);
`bundle create` copies it to `states/<input>.npy`, where the manifest's `files` hash it and the signature
covers it like every file. Loading checks its hash, shape and dtype against the declaration before any
window is served; errors name the key and the file.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from agent.errors import BundleError
from agent.hashing import sha256_file
from agent.spec.manifest import ExtraInput

STATES_DIR = "states"


def copy_state_files(spec: dict[str, Any], spec_dir: Path, root: Path, where: str) -> None:
    """Copy each `init_file` a spec names into the bundle and point the spec's input at its bundle path."""
    for i, d in enumerate(spec.get("inputs") or []):
        given = d.get("init_file")
        if not given:
            continue
        src = spec_dir / given
        if not src.is_file():
            raise BundleError(f"{where}: key inputs[{i}].init_file: {src} is not a file (a .npy, from the spec's folder)")
        rel = f"{STATES_DIR}/{d['name']}.npy"
        (root / STATES_DIR).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, root / rel)
        d["init_file"] = rel


def load_state_files(root: Path, inputs: tuple[ExtraInput, ...], where: str,
                     files: Mapping[str, str] | None = None) -> tuple[ExtraInput, ...]:
    """`inputs` with each `init_file` read into `init_value`; `files` (the manifest's hashes) checked first."""
    out = []
    for i, x in enumerate(inputs):
        if x.init_file is None:
            out.append(x)
            continue
        key = f"inputs[{i}].init_file"
        if x.kind != "state":
            raise BundleError(f"{where}: key {key}: only a state input starts from a file (this one is {x.kind})")
        rel = x.init_file
        path = root / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts or not path.is_file():
            raise BundleError(f"{where}: key {key}: {rel} is not a file inside the bundle")
        if files is not None:  # read only what the manifest hashes (verify_files checks every file again)
            if rel not in files:
                raise BundleError(f"{where}: key {key}: {rel} is not listed in the manifest's files (not covered by its hashes)")
            if sha256_file(path) != files[rel]:
                raise BundleError(f"{where}: key {key}: {path}: hash mismatch: the file changed after the bundle was built")
        try:
            value = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise BundleError(f"{where}: key {key}: {rel} is not a .npy array ({exc})") from exc
        shape = tuple(int(d) if isinstance(d, int) else -1 for d in x.shape)
        if value.shape != shape:
            raise BundleError(f"{where}: key {key}: {rel} holds shape {list(value.shape)}, the state "
                              f"{x.name!r} is declared {list(x.shape)}")
        if value.dtype != np.dtype(x.dtype):
            raise BundleError(f"{where}: key {key}: {rel} holds {value.dtype}, the state {x.name!r} is declared {x.dtype}")
        out.append(dataclasses.replace(x, init_value=value))
    return tuple(out)
