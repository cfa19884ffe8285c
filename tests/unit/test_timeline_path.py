"""A timeline file that cannot be created is a psrt error naming what asked for it and the
path, raised by init() (for PSRT_TIMELINE) or start_timeline(), not a bare FileNotFoundError."""
from __future__ import annotations

import pytest

import psrt.torch as hvd
from psrt.errors import InvalidArgumentError


def test_psrt_timeline_in_a_missing_directory_fails_init_naming_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("PSRT_ABORT_ON_EXCEPTION", "0")  # raise here instead of ending the process
    monkeypatch.setenv("PSRT_TIMELINE", "/nonexistent/x")
    with pytest.raises(InvalidArgumentError, match="PSRT_TIMELINE: cannot write the timeline to '/nonexistent/x' "
                                                   r"\(No such file or directory\)"):
        hvd.init()
    assert not hvd.is_initialized()
    monkeypatch.setenv("PSRT_TIMELINE", str(tmp_path / "timeline.json"))
    hvd.init()
    try:
        assert (tmp_path / "timeline.json").exists()
        with pytest.raises(InvalidArgumentError, match=r"start_timeline\(\): cannot write the timeline to "
                                                       f"'{tmp_path}/no/such/dir.json'"):
            hvd.start_timeline(str(tmp_path / "no" / "such" / "dir.json"))
    finally:
        hvd.shutdown()
