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
