"""psrt's checkpoint files: one writer and one reader under every strategy's checkpoint.

:mod:`psrt.checkpoint.files` writes tensors as safetensors files, fsynced with their
directory before the commit record that holds their sizes and sha256 is written last, and
reads a file only once it matches its record; :mod:`psrt.checkpoint.document` says how a
document of tensors and plain data travels in such a file.  ZeRO, the parameter servers,
elastic commits, ``save_pretrained`` and ``psrt zero-to-full`` all write through them.
"""
