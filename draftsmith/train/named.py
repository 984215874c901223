"""The one loader of objects named "package.module:attribute": the CLI's jobs, the hook's collaborators
and user-named pipeline stages all resolve through it, with one kind of error.

A name whose module is absent, or that lacks the attribute, is a ValueError naming the role and the
name; an import error *inside* an existing module is a bug and propagates with its stack.
"""
from __future__ import annotations

import importlib
from typing import Any


def resolve(name: str, role: str) -> Any:
    """The object `name` ("module:attr") denotes; `role` says what it was meant to be, for the message."""
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{role}: {name!r} is not of the form 'package.module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and module_name.startswith(err.name):
            raise ValueError(f"{role} {name}: module {module_name} is not installed or not in this checkout") from None
        raise
    if not hasattr(module, attr):
        raise ValueError(f"{role} {name}: {module_name} has no {attr}")
    return getattr(module, attr)
