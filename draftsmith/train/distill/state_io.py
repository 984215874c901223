"""Pickle-free storage of nested training state: tensors in safetensors, the rest in JSON.

Optimizer, LR-scheduler and RNG states are trees of dicts, lists, tuples, numbers, strings and
tensors. ``save_state_tree(tree, dir, stem)`` writes ``<stem>.safetensors`` (every tensor, under
keys ``t0, t1, ...``) and ``<stem>.json`` (the tree with each tensor replaced by a reference), so
reading a checkpoint back never runs an unpickler: a checkpoint file can hold data, never code.

JSON cannot say "int key" or "tuple", and optimizer states have both (``state[0]``, ``betas``):
such nodes are tagged (``{"__dict__": [[k, v], ...]}``, ``{"__tuple__": [...]}``) so a tree comes
back exactly as it was saved.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FORMAT = "draftsmith-state/1"
_TENSOR, _TUPLE, _DICT = "__tensor__", "__tuple__", "__dict__"
_SCALARS = (bool, int, float, str, type(None))


def _encode(node: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    if isinstance(node, torch.Tensor):
        key = f"t{len(tensors)}"
        # Own contiguous CPU copy: safetensors refuses tensors that share storage or are strided views.
        tensors[key] = node.detach().to("cpu", copy=True).contiguous()
        return {_TENSOR: key}
    if isinstance(node, _SCALARS):
        return node
    if hasattr(node, "item") and getattr(node, "shape", None) == ():  # numpy scalar
        return node.item()
    if isinstance(node, tuple):
        return {_TUPLE: [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(node)]}
    if isinstance(node, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(node)]
    if isinstance(node, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in node):
            return {k: _encode(v, tensors, f"{where}.{k}") for k, v in node.items()}
        return {_DICT: [[_encode(k, tensors, where), _encode(v, tensors, f"{where}[{k!r}]")] for k, v in node.items()]}
    raise TypeError(f"{where}: {type(node).__name__} cannot be stored without pickle")


def _decode(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, list):
        return [_decode(v, tensors) for v in node]
    if not isinstance(node, dict):
        return node
    if _TENSOR in node:
        return tensors[node[_TENSOR]]
    if _TUPLE in node:
        return tuple(_decode(v, tensors) for v in node[_TUPLE])
    if _DICT in node:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in node[_DICT]}
    return {k: _decode(v, tensors) for k, v in node.items()}


def state_files(stem: str) -> tuple[str, str]:
    """The two file names `save_state_tree` writes for `stem`."""
    return f"{stem}.json", f"{stem}.safetensors"


def save_state_tree(tree: Any, directory: str | Path, stem: str) -> None:
    directory = Path(directory)
    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(tree, tensors, stem)
    json_name, tensor_name = state_files(stem)
    save_file(tensors, str(directory / tensor_name))
    (directory / json_name).write_text(json.dumps({"format": FORMAT, "tree": encoded}))


def load_state_tree(directory: str | Path, stem: str) -> Any:
    """The tree `save_state_tree` wrote (tensors on CPU); ValueError naming the file when it is unreadable."""
    directory = Path(directory)
    json_name, tensor_name = state_files(stem)
    for name in (json_name, tensor_name):
        if not (directory / name).is_file():
            raise ValueError(f"{directory / name}: missing")
    document = json.loads((directory / json_name).read_text())
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ValueError(f"{directory / json_name}: not a {FORMAT} file")
    return _decode(document["tree"], load_file(str(directory / tensor_name)))
