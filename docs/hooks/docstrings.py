"""MkDocs hook: psrt's docstrings use Sphinx roles (``:class:`KVStore```, ``:func:`init```);
the API reference shows the name as code, without the role in front of it."""
from __future__ import annotations

import re

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):(?=<code>)")


def on_page_content(html: str, **kwargs) -> str:
    return _ROLE.sub("", html)
