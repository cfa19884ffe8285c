"""A checkpoint document (nested dicts, lists and tuples of tensors and plain values) as
safetensors tensors plus a JSON skeleton, and back.

psrt's checkpoint files hold documents such as a ZeRO shard's ``{"masters": [tensor],
"optimizer_state": [{"step": tensor, ...}], "param_groups": [...]}``.  safetensors stores
named tensors and a string-to-string metadata table, and nothing that can run code when
read; so each tensor is stored under its path in the document (``"model.body.weight"`` for
``document["model"]["body.weight"]``, ``"optimizer_state.0.exp_avg"``; a repeated path gets a
``#n`` suffix), which any safetensors reader shows, and the rest of the document as JSON in
the metadata, tensors replaced by ``{"$tensor": name}``.  Files of earlier psrt name tensors
by position (``"0"``, ``"1"``, ...): the skeleton says which, so both decode alike.  JSON lacks
a few things documents hold, which are tagged: tuples (``{"$tuple": [...]}``), dicts
whose keys are not all strings (torch's optimizer state, keyed by parameter index), bytes,
``torch.dtype`` and ``torch.Size``.  Anything else is refused, naming where it is: a
document is data, never objects.
"""
from __future__ import annotations

import base64
import json
from collections.abc import Callable

import torch

_TAGS = ("$tensor", "$tuple", "$dict", "$bytes", "$dtype", "$size")


def encode(document: object) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors of ``document`` (host, contiguous, none sharing memory with another, as
    safetensors requires) by position, and the JSON skeleton that puts them back."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def walk(value: object, where: str, path: str) -> object:
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu()
            pointer = tensor.untyped_storage().data_ptr()
            if not tensor.is_contiguous() or (pointer and pointer in seen):
                tensor = tensor.contiguous().clone()
                pointer = tensor.untyped_storage().data_ptr()
            seen.add(pointer)
            key = path or "tensor"
            if key in tensors:
                key = f"{key}#{len(tensors)}"
            tensors[key] = tensor
            return {"$tensor": key}
        if isinstance(value, (bool, int, float, str)) or value is None:
            return value
        if isinstance(value, torch.Size):
            return {"$size": list(value)}
        if isinstance(value, tuple):
            return {"$tuple": [walk(item, f"{where}[{i}]", _join(path, i)) for i, item in enumerate(value)]}
        if isinstance(value, list):
            return [walk(item, f"{where}[{i}]", _join(path, i)) for i, item in enumerate(value)]
        if isinstance(value, dict):
            if all(isinstance(key, str) for key in value) and not set(value) & set(_TAGS):
                return {key: walk(item, f"{where}[{key!r}]", _join(path, key)) for key, item in value.items()}
            return {"$dict": [[walk(key, where, _join(path, key)), walk(item, f"{where}[{key!r}]", _join(path, key))]
                              for key, item in value.items()]}
        if isinstance(value, bytes):
            return {"$bytes": base64.b64encode(value).decode("ascii")}
        if isinstance(value, torch.dtype):
            return {"$dtype": str(value).removeprefix("torch.")}
        raise TypeError(f"{where} is a {type(value).__name__}: a checkpoint holds tensors and plain data "
                        "(numbers, strings, lists, tuples, dicts) only")

    skeleton = walk(document, "the document", "")
    return tensors, json.dumps(skeleton)


def map_tensors(value: object, change: Callable[[object], object], kinds: tuple[type, ...] = (torch.Tensor,)
                ) -> object:
    """``value`` (dicts, lists and tuples of tensors and plain data) with ``change`` applied to
    each leaf of one of ``kinds`` (tensors, or such stand-ins as a tensor still in its file);
    the rest is kept as it is."""
    if isinstance(value, kinds):
        return change(value)
    if isinstance(value, dict):
        return {key: map_tensors(item, change, kinds) for key, item in value.items()}
    if isinstance(value, list):
        return [map_tensors(item, change, kinds) for item in value]
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        return tuple(map_tensors(item, change, kinds) for item in value)
    return value


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def decode(tensors: dict[str, torch.Tensor], skeleton: str) -> object:
    """The document :func:`encode` split; raises ``ValueError`` for a skeleton it did not write."""

    def walk(value: object) -> object:
        if isinstance(value, list):
            return [walk(item) for item in value]
        if not isinstance(value, dict):
            return value
        tag = next((key for key in _TAGS if key in value), None)
        if tag is None:
            return {key: walk(item) for key, item in value.items()}
        body = value[tag]
        if tag == "$tensor":
            if body not in tensors:
                raise ValueError(f"the skeleton names tensor {body!r}, which the file lacks")
            return tensors[body]
        if tag == "$tuple":
            return tuple(walk(item) for item in body)
        if tag == "$dict":
            return {_hashable(walk(key)): walk(item) for key, item in body}
        if tag == "$bytes":
            return base64.b64decode(body)
        if tag == "$size":
            return torch.Size(body)
        dtype = getattr(torch, str(body), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {body!r}")
        return dtype

    return walk(json.loads(skeleton))


def _hashable(key: object) -> object:
    if isinstance(key, (list, dict)):
        raise ValueError(f"a dict key cannot be a {type(key).__name__}")
    return key
