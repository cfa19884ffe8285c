"""MkDocs hook: the benchmark method, tables and plots, which live in benchmarks/, on the site.

benchmarks/README.md (how each benchmark runs) and benchmarks/RESULTS.md (the current
tables) become the pages benchmarks/method.md and benchmarks/results.md, read at build time
so that the site never holds a stale copy.  They are written for GitHub, with links relative
to benchmarks/: links into docs/ are pointed at the site's pages, links to plots and to the
two files themselves stay, and links to anything else in the repository (a benchmark's
source, say) become its path in code, since the site holds no source files.

Every PNG in benchmarks/plots/ is copied to benchmarks/plots/ on the site.  A page shows one
with a marker on a line of its own:

    <!-- plot: allreduce_busbw.png "Allreduce bus bandwidth against message size" -->

which becomes the image where the PNG exists and a line saying it has not been drawn yet
where it does not, so the build passes before and after the benchmarks write their plots.
``PSRT_DOCS_PLOTS`` names another directory of plots (tests use it).
"""
from __future__ import annotations

import logging
import os
import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.benchmarks")

ROOT = Path(__file__).resolve().parents[2]  # docs/hooks/ -> the repository
PAGES = {"benchmarks/README.md": "benchmarks/method.md", "benchmarks/RESULTS.md": "benchmarks/results.md"}
PLOTS = "benchmarks/plots"
_LINK = re.compile(r'(!?)\[([^\]]*)\]\(([^)\s]+)((?:\s+"[^"]*")?)\)')
_PLOT = re.compile(r'^<!-- plot: ([\w.-]+\.png) "([^"]+)" -->$', re.MULTILINE)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def on_files(files, config):
    for repo_path, site_path in PAGES.items():
        if (ROOT / repo_path).is_file():
            files.append(File.generated(config, site_path, abs_src_path=str(ROOT / repo_path)))
        else:
            log.warning(f"{repo_path} is missing, so the site has no {site_path}")
    plots = Path(os.environ.get("PSRT_DOCS_PLOTS") or ROOT / PLOTS)
    for png in sorted(plots.glob("*.png")):
        files.append(File.generated(config, f"{PLOTS}/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    here = posixpath.dirname(page.file.src_uri)
    source = {site: repo for repo, site in PAGES.items()}.get(page.file.src_uri)
    if source is not None:
        markdown = _LINK.sub(lambda m: _relink(m, posixpath.dirname(source), here, files), markdown)
    return _PLOT.sub(lambda m: _plot(m.group(1), m.group(2), here, files), markdown)


def _site_path(repo_path: str) -> str | None:
    """Where a file of the repository is on the site, if it is there at all."""
    if repo_path in PAGES:
        return PAGES[repo_path]
    if repo_path.startswith("docs/"):
        return repo_path[len("docs/"):]
    if repo_path.startswith(PLOTS + "/"):
        return repo_path
    return None


def _relink(match: re.Match, repo_dir: str, here: str, files) -> str:
    bang, text, target, title = match.groups()
    if _SCHEME.match(target) or target.startswith(("#", "/")):
        return match.group(0)
    path, hash_, anchor = target.partition("#")
    repo_path = posixpath.normpath(posixpath.join(repo_dir, path))
    site = _site_path(repo_path)
    if site is not None and files.get_file_from_path(site) is not None:
        return f"{bang}[{text}]({posixpath.relpath(site, here)}{hash_}{anchor}{title})"
    if bang:
        return f"*{text or repo_path}* (`{repo_path}`, not in this checkout)"
    return f"`{repo_path}`" if text.strip("`") in (repo_path, path) else f"{text} (`{repo_path}`)"


def _plot(name: str, caption: str, here: str, files) -> str:
    site = f"{PLOTS}/{name}"
    if files.get_file_from_path(site) is None:
        return f"*{caption}*: `{site}` has not been drawn in this checkout yet."
    return f"![{caption}]({posixpath.relpath(site, here)})\n\n*{caption}*"
