""""Did you mean" for misspelled keyword arguments of the public configuration objects.

``MoEConfig(d_modle=512)`` would otherwise end in Python's bare "unexpected keyword argument";
the classes decorated with :func:`suggest_unknown_kwargs` raise a ``TypeError`` that names the
unknown keyword, the closest valid ones (:mod:`difflib`) and where the full list lives, before
the constructor runs. Core floor: imports only the standard library.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from typing import Iterable, TypeVar

__all__ = ["UNSET", "did_you_mean", "renamed_argument", "suggest_unknown_kwargs", "unknown_keyword_error"]

T = TypeVar("T", bound=type)


def did_you_mean(name: str, choices: Iterable[str], n: int = 3) -> str:
    """``"; did you mean 'x' or 'y'?"`` for the closest ``choices`` to ``name``, or ``""``."""
    choices = list(choices)
    close = difflib.get_close_matches(name, choices, n=n, cutoff=0.6)
    if not close:
        # A prefix or a substring counts too (``expert`` -> ``expert_bias``, ``expert_ffn_bias``).
        close = [c for c in choices if name and (c.startswith(name) or name in c)][:n]
    if not close:
        return ""
    return "; did you mean " + " or ".join(repr(c) for c in close) + "?"


def unknown_keyword_error(owner: str, name: str, valid: Iterable[str]) -> TypeError:
    """The ``TypeError`` for keyword ``name`` that ``owner`` does not take."""
    valid = sorted(valid)
    return TypeError(
        f"{owner}() got an unexpected keyword argument {name!r}{did_you_mean(name, valid)} "
        f"(it takes: {', '.join(valid)})"
    )


def suggest_unknown_kwargs(cls: T) -> T:
    """Class decorator: unknown keyword arguments of ``cls(...)`` raise :func:`unknown_keyword_error`.

    Apply it above ``@dataclass`` (so it wraps the generated ``__init__``). ``dataclasses.replace``
    goes through the same check. Classes whose ``__init__`` takes ``**kwargs`` are left as they are.
    """
    init = cls.__init__
    params = inspect.signature(init).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return cls
    valid = frozenset(
        n for n, p in params.items()
        if n != "self" and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    )

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        for name in kwargs:
            if name not in valid:
                raise unknown_keyword_error(cls.__name__, name, valid)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


#: The default of a deprecated argument: "not passed" (None can be a real value).
UNSET = object()


def renamed_argument(owner: str, new: str, new_value, old: str, old_value, *, new_default=None):
    """The value of argument ``new`` when callers may still pass its deprecated name ``old``.

    Passing ``old`` warns (``DeprecationWarning`` naming the new name) and returns its value;
    passing both raises ``TypeError``. ``old_value`` is :data:`UNSET` when the caller did not pass it.
    """
    import warnings

    if old_value is UNSET:
        return new_value
    if new_value is not new_default:
        raise TypeError(f"{owner}() got both {new}= and its deprecated name {old}=; pass only {new}=")
    warnings.warn(f"{owner}({old}=...) is deprecated: use {new}= (same meaning)", DeprecationWarning, stacklevel=3)
    return old_value
