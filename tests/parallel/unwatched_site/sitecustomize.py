"""Loads the unwatched-wait checker (``tests/parallel/unwatched.py``) into every Python process
of a job whose environment has ``PSRT_TEST_UNWATCHED=1`` and this folder on ``PYTHONPATH``."""
import importlib.util
import os
import sys

if os.environ.get("PSRT_TEST_UNWATCHED") in ("1", "all"):
    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unwatched.py")
    _spec = importlib.util.spec_from_file_location("unwatched", _path)
    _module = sys.modules["unwatched"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    _module.install()
