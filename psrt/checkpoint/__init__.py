"""psrt's checkpoint files: one writer and one reader under every strategy's checkpoint.

:mod:`psrt.checkpoint.files` writes tensors as safetensors files, fsynced with their
directory before the commit record that holds their sizes and sha256 is written last, and
reads a file only once it matches its record; :mod:`psrt.checkpoint.document` says how a
document of tensors and plain data travels in such a file.  ZeRO, the parameter servers,
elastic commits, ``save_pretrained`` and ``psrt zero-to-full`` all write through them.
:mod:`psrt.checkpoint.dcp` gives ``torch.distributed.checkpoint`` users the same checks: a
storage writer that records each file's size and sha256 in DCP's ``.metadata``, and a reader
that refuses a file that does not match before any tensor is loaded.
"""
from __future__ import annotations

from psrt.checkpoint import files
from psrt.errors import CheckpointError

__all__ = ["load_document"]


def load_document(path: str) -> object:
    """The document (tensors and plain data) in a checkpoint file psrt wrote, such as the
    output of ``psrt zero-to-full``: its header validated, nothing in it run; raises
    :class:`~psrt.errors.CheckpointError` naming the file and what is wrong."""
    return files.load_tensors(path, None, CheckpointError)
