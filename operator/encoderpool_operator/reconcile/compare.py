"""Does a live object already carry what we would apply? (What keeps a no-op pass write-free.)"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from encoderpool_operator.api import parse_quantity


def _same_scalar(want: Any, have: Any) -> bool:
    if want == have:
        return True
    if isinstance(want, (str, int)) and isinstance(have, (str, int)):
        try:  # "500m" == "0.5": the API server canonicalizes quantities
            return parse_quantity(want) == parse_quantity(have)
        except ValueError:
            return False
    return False


def is_subset(want: Any, have: Any) -> bool:
    """Does the live object already carry every field we would apply?

    Fields the server or other controllers add are ignored; lists must match
    element by element. This is what keeps a no-op reconcile free of writes,
    while a hand edit of a field we own is still put back.
    """
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(
            k in have and is_subset(v, have[k]) for k, v in want.items()
        )
    if isinstance(want, list):
        return (
            isinstance(have, list)
            and len(want) == len(have)
            and all(is_subset(w, h) for w, h in zip(want, have, strict=True))
        )
    return _same_scalar(want, have)
