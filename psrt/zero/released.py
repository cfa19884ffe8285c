"""Stage 3's released parameters refuse to be read, instead of reading freed memory.

Between uses a stage-3 parameter is a view of its flat group's buffer whose storage is
resized to zero bytes: it keeps its shape and dtype, and autograd's saved references to it
see the values again once the group is gathered, but torch reads it from a null pointer
(a segfault, or freed memory).  So while its group is released, the parameter's class is
switched to a subclass whose ``__torch_function__`` refuses every operation except reading
metadata (shape, dtype, device, ``requires_grad``, ``grad`` and hooks), raising
:class:`~psrt.errors.ParameterReleasedError` naming the parameter; gathering switches it
back to its own class, so a forward pays nothing.  torch's ``UninitializedParameter`` changes
class the same way when it is materialised.

A 0-element placeholder (``param.data = torch.empty(0)``, DeepSpeed's way) was not chosen:
reads of it succeed silently (``sum()`` is 0, ``clone()`` is empty), it breaks views that
autograd saved during forward, and shape checks no longer see the real shape.  A tensor
subclass kept for the whole run would pay a Python call on every operation of a forward.
What stays the caller's responsibility: a view or copy taken *inside* a gather (``p.data``,
``p.t()``) must not be used after it; ``state_dict()`` taken inside
``opt.gathered_parameters()`` holds copies for that reason.
"""
from __future__ import annotations

import functools

import torch
from torch.utils._pytree import tree_flatten

from psrt.errors import ParameterReleasedError

#: Attributes (read or written) and methods a released parameter still answers: metadata,
#: where its (empty) storage is, its gradient (a tensor of its own), and hook registration.
#: Everything else reads its values.
_METADATA = frozenset({
    "shape", "dtype", "device", "layout", "ndim", "requires_grad", "is_leaf", "grad", "grad_fn", "_version",
    "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "output_nr",
    "nbytes", "itemsize", "_backward_hooks", "_post_accumulate_grad_hooks",
    "size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "stride",
    "is_contiguous", "get_device", "untyped_storage", "data_ptr", "storage_offset",
    "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "__hash__", "__len__", "__format__",
})
_NAME = "_psrt_zero_name"
_OWN_CLASS = "_psrt_zero_class"


class _Released:
    """Mixed in before a parameter's own class while its values are released."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if _function_name(func) in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        released = next((t for t in tree_flatten((args, kwargs))[0] if isinstance(t, _Released)), None)
        raise ParameterReleasedError(
            f"ZeRO stage 3: parameter {getattr(released, _NAME, '?')!r} was read ({_function_name(func)}) while "
            "released: it is sharded over the data-parallel ranks and holds values only during the forward and "
            "backward of its unit (by default its block, or the whole model; see ZeroOptimizer's units=). Read it "
            "inside `with opt.gathered_parameters():` (collective: on every rank), call the model (or the module "
            "that registers it) rather than reading it from outside, or use opt.save() and psrt zero-to-full")

    def __repr__(self) -> str:
        return (f"ZeRO stage-3 parameter {getattr(self, _NAME, '?')!r} (released; shape {tuple(self.shape)}, "
                f"{self.dtype})")


def _function_name(func) -> str:
    """The attribute or method ``func`` stands for: a property's getter or setter comes as
    ``<method-wrapper '__get__' of getset_descriptor 'grad'>``."""
    owner = getattr(func, "__self__", None)
    if getattr(func, "__name__", "") in ("__get__", "__set__", "__delete__") and owner is not None:
        return getattr(owner, "__name__", "")
    return getattr(func, "__name__", "")


@functools.cache
def _released_class(own: type) -> type:
    return type(f"Released{own.__name__}", (_Released, own), {})


def classes_of(param: torch.nn.Parameter) -> tuple[type, type]:
    """``param``'s own class and the class it takes while released, for a caller that switches
    many parameters at once by assigning ``__class__`` (one pass, no call per parameter);
    :func:`mark_gathered` knows the own class afterwards too."""
    own = getattr(param, _OWN_CLASS) if isinstance(param, _Released) else type(param)
    setattr(param, _OWN_CLASS, own)
    return own, _released_class(own)


def name_parameter(param: torch.nn.Parameter, name: str) -> None:
    """Record the name errors give ``param`` (its registration name in the wrapped model)."""
    setattr(param, _NAME, name)


def mark_released(param: torch.nn.Parameter) -> None:
    """From now on, reading ``param`` raises (its storage is about to be, or was, freed)."""
    if not isinstance(param, _Released):
        setattr(param, _OWN_CLASS, type(param))
        param.__class__ = _released_class(type(param))


def mark_gathered(param: torch.nn.Parameter) -> None:
    """``param`` holds its values again: back to its own class."""
    if isinstance(param, _Released):
        param.__class__ = getattr(param, _OWN_CLASS)


def is_released(param: torch.Tensor) -> bool:
    return isinstance(param, _Released)
