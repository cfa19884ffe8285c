"""Where a thread is, in its user's terms: the first frame outside psrt, torch and Python's
own library (the user's line), and the psrt function called from there
(``ZeroOptimizer.save``).

Read from another thread (the watchdog's), only when a report needs it.
"""
from __future__ import annotations

import os
import sys
import sysconfig
from types import FrameType

_PSRT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_PATHS = sysconfig.get_paths()
_STDLIB_DIR = os.path.abspath(_PATHS["stdlib"]) + os.sep
# Installed packages count as the user's code (Lightning's, transformers'), wherever the
# layout puts them: below the standard library (pyenv, conda) or apart (a venv).
_SITE_DIRS = tuple({os.path.abspath(_PATHS[key]) + os.sep for key in ("purelib", "platlib")})


def _is_library(filename: str) -> bool:
    """Whether a frame of ``filename`` is nobody's call site: torch's, or Python's own library."""
    torch = sys.modules.get("torch")
    path = getattr(torch, "__file__", None)
    if path and filename.startswith(os.path.dirname(os.path.abspath(path)) + os.sep):
        return True
    return filename.startswith(_STDLIB_DIR) and not filename.startswith(_SITE_DIRS)


def _name(frame: FrameType) -> str:
    code = frame.f_code
    return getattr(code, "co_qualname", code.co_name)


def locate(thread_id: int | None) -> tuple[str, str]:
    """(``"train.py:31 (in main)"``, ``"ZeroOptimizer.save"``) for the thread's innermost
    frame outside the libraries and the outermost psrt function below it; empty strings
    for what is not there (a thread in psrt called from no Python frame: ``atexit``)."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    api = ""
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if filename.startswith(_PSRT_DIR):
            api = _name(frame)
        elif not _is_library(filename):
            return f"{_short(filename)}:{frame.f_lineno} (in {_name(frame)})", api
        frame = frame.f_back
    return "", api


def _short(filename: str) -> str:
    """A path relative to the working directory when it lies below it."""
    try:
        relative = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if relative.startswith("..") else relative
