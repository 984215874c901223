"""Proposers by method: each proposer module registers its class here (`@register_proposer("eagle")`).

Every module of this package is imported on the first lookup, so adding a draft kind's proposer is
adding a file; no table of "module:Class" strings to keep in step with the kinds.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import TypeVar

_PROPOSERS: dict[str, type] = {}
_discovered = False
P = TypeVar("P", bound=type)


def register_proposer(method: str) -> Callable[[P], P]:
    def register(cls: P) -> P:
        if _PROPOSERS.get(method, cls) is not cls:
            raise ValueError(f"proposer method {method!r} is registered twice ({_PROPOSERS[method].__name__}, "
                             f"{cls.__name__})")
        _PROPOSERS[method] = cls
        return cls
    return register


def _discover() -> None:
    global _discovered
    if not _discovered:
        package = importlib.import_module(__package__)
        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{__package__}.{info.name}")
        _discovered = True


def proposer_methods() -> tuple[str, ...]:
    _discover()
    return tuple(sorted(_PROPOSERS))


def proposer_class(method: str) -> type:
    """The proposer class of `method`, or ValueError naming the methods there are."""
    _discover()
    if method not in _PROPOSERS:
        raise ValueError(f"speculative method {method!r} is not one of {list(proposer_methods())}")
    return _PROPOSERS[method]
