"""Stand-ins for fla's chunk_kda in CPU tests: bind a call the way fla's signature would."""

from __future__ import annotations

import inspect


def bind_as(sig: inspect.Signature, args: tuple, kwargs: dict) -> tuple[dict, dict]:
    """(named arguments with defaults applied, what went to **kwargs); raises TypeError on an
    argument the signature does not take."""
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    a = dict(bound.arguments)
    return a, a.pop("kwargs", {})
