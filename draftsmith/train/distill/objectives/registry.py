"""Objectives by draft kind: each objective module registers a builder (`@register_objective("eagle")`).

Every module of this package is imported on the first lookup, so a new kind's objective is a new
file here, not an edit to a dispatch on kind names.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

# (draft config, teacher or None, target dir, the draft module) -> the kind's Objective
Builder = Callable[[Any, Any, Path, nn.Module], Any]
_BUILDERS: dict[str, Builder] = {}
_discovered = False


def register_objective(kind: str) -> Callable[[Builder], Builder]:
    def register(build: Builder) -> Builder:
        if _BUILDERS.get(kind, build) is not build:
            raise ValueError(f"objective for draft kind {kind!r} is registered twice")
        _BUILDERS[kind] = build
        return build
    return register


def objective_builder(kind: str) -> Builder:
    global _discovered
    if not _discovered:
        package = importlib.import_module(__package__)
        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{__package__}.{info.name}")
        _discovered = True
    if kind not in _BUILDERS:
        raise ValueError(f"draft.kind: {kind!r} has no objective (kinds with one: {', '.join(sorted(_BUILDERS))})")
    return _BUILDERS[kind]
