"""Checking a job's listening sockets (printed by a rank with ``scripts/_listeners.py`` as a
``listeners: [...]`` line) against psrun's note about its launcher's (launcher/listeners.py);
on ``sys.path`` through setup.cfg's ``pythonpath = tests``."""
from __future__ import annotations

import json
import re

_NOTE = re.compile(r"^psrun: note: (.*) for this job", re.MULTILINE)
_ADDRESS = re.compile(r"(?:\d+\.\d+\.\d+\.\d+|\[[0-9a-f:.]+\]):\d+")


def assert_only_the_noted_launcher_listens(output: str, ranks_noted: bool = False) -> list[dict]:
    """The job's output (stdout and psrun's stderr) holds a snapshot in which nothing listens
    beyond loopback but the MPI launcher, and psrun's note names exactly those sockets.
    ``ranks_noted``: the ranks' own every-address sockets are allowed too where the note says
    that they bind every address (Open MPI's btl tcp across hosts)."""
    lines = [line for line in output.splitlines() if line.startswith("listeners: ")]
    assert lines, f"no rank printed the job's listeners\n{output[-3000:]}"
    sockets = json.loads(lines[0].removeprefix("listeners: "))
    beyond = [s for s in sockets if s["exposed"]]
    notes = _NOTE.findall(output)
    if ranks_noted:
        assert notes and "the ranks' TCP transport (btl tcp) on every host" in output, notes
        ranks = [s for s in beyond if s["role"] == "rank"]
        assert all(s["listens_on"].startswith(("0.0.0.0:", "[::]:")) for s in ranks), ranks
        beyond = [s for s in beyond if s not in ranks]
    assert all(s["role"] == "launcher" for s in beyond), f"listening beyond loopback: {beyond}"
    assert len(notes) == (1 if beyond else 0), f"psrun's notes {notes} about {beyond}\n{output[-3000:]}"
    named = set(_ADDRESS.findall(notes[0])) if notes else set()
    assert named == {s["listens_on"] for s in beyond}, f"psrun's note {notes} names {named}, the job: {beyond}"
    return sockets
