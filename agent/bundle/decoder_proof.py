"""A decoder is never proven against itself: `bundle create` refuses a decoding bundle without the package's answers.

A bundle whose result is *decoded* from a raw layout (boxes from a detection head, masks from a map, text from
CTC steps: the vocabulary's `detection` / `segmentation` decoders or a post graph serving `boxes`, `masks` or
`text`) is judged at build and on the device by its final result. Without the package's own end-to-end answers
(`answers.json` in the golden or held-out set) the only thing to judge it against is our own decoding of the
source's tensors: a decoder wrong on both sides (a YOLOX raw head declared `layout: yolov5`) then agrees with
itself (issue 42: "recall 0.994" over 156 boxes where the package finds 30). So the build refuses it, naming the
missing answers, unless the author passes `--allow-unproven-decoder`; the bundle is then built with the warning
in its manifest (`source.unproven_decoder`), which the self-test's report repeats.

Kinds read one-to-one from a tensor (`classes`: an argmax; `scores`: a value per channel) have no layout to get
wrong and are not refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agent.errors import BundleError
from agent.logsetup import get_logger
from agent.vocabulary.kinds import declaration, vocabulary_kinds

log = get_logger("bundle.create")

FLAG = "--allow-unproven-decoder"
MANIFEST_KEY = "source.unproven_decoder"


def served_kind(spec: Mapping[str, Any]) -> tuple[str | None, str]:
    """The kind the spec serves and the key that says so."""
    post = spec.get("postprocess") or {}
    declared = (post.get("result") or {}).get("kind")
    if declared:
        return str(declared), "postprocess.result.kind"
    kind = vocabulary_kinds().get(str(post.get("type", "")))  # the vocabulary's decoding tasks as result kinds
    return (kind if _decoded(kind) else None), f"postprocess.type {post.get('type')}"


def _decoded(kind: str | None) -> bool:
    """A kind whose values come from reading positions in a raw layout (its declaration says)."""
    decl = declaration(kind) if kind else None
    return decl is not None and decl.decoded


def unproven_decoder(spec: Mapping[str, Any], golden: Path, heldout: Path | None, have_golden_answers: bool,
                     have_held_answers: bool, allow: bool, sequence: bool) -> str | None:
    """None when the decoder is proven (or there is none to prove); else the warning the manifest carries when
    the author allowed it. Refuses (BundleError naming the missing answers and the flag) when not allowed."""
    kind, key = served_kind(spec)
    if sequence or not _decoded(kind) or have_golden_answers or have_held_answers:
        return None
    post = spec.get("postprocess") or {}
    how = (f", post graph {post['graph']!r}" if post.get("graph")
           else f", layout {post.get('layout')!r}" if post.get("layout") else "")
    where = f"{golden}" + (f" and {heldout}" if heldout is not None else "")
    text = (f"the decoder ({key}: {kind!r}{how}) is not proven: {where} hold no package answers "
            f"(answers.json, the package's own end-to-end results), so its results could only be judged against "
            f"our own decoding of the same tensors, which a wrong decoder passes")
    if not allow:
        raise BundleError(f"refusing the bundle: {text}; give the package's answers as answers.json beside the golden "
                          f"frames (docs/bundle-create.md), or pass {FLAG} to build it with this warning in the "
                          f"manifest ({MANIFEST_KEY})")
    log.warning("bundle.create.unproven_decoder", kind=kind, key=key, warning=text)
    return text
