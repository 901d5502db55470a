"""A malformed package answer is an error naming its sample, whatever the counts (a quiet pass or a bare count
mismatch would hide which answer is bad)."""

from __future__ import annotations

import pytest

from agent.errors import BundleError
from agent.results import kind_for


BAD = {
    "boxes": {"type": "boxes", "boxes": [{"box": "x"}]},
    "classes": {"type": "classes", "top": "x"},
    "text": {"type": "text", "text": 5},
}


@pytest.mark.parametrize("kind", sorted(BAD))
@pytest.mark.parametrize("n_served", [1, 0])
def test_malformed_answer_is_an_error_naming_the_sample(kind: str, n_served: int) -> None:
    k = kind_for(kind)
    served = [BAD[kind]] * n_served
    with pytest.raises(BundleError, match="sample 0"):
        k.fidelity(served, [BAD[kind]], {})
