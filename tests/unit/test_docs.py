"""The documentation site builds with --strict, and what is generated from the code covers
the code: every Config field, every psrun and psrt option, every public API name, every
error class (in the troubleshooting guide), every benchmark plot.

The site is built once, in a subprocess, into a temporary directory, with
``PSRT_DOCS_PLOTS`` pointing at a copy of benchmarks/plots/ completed with stand-ins for the
plots no benchmark has drawn yet, so the build is checked as it will be once they exist.
"""
from __future__ import annotations

import argparse
import ast
import html
import importlib.util
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
from dataclasses import fields
from pathlib import Path

import pytest

for _package in ("mkdocs", "material", "mkdocstrings_handlers.python"):
    pytest.importorskip(_package, reason="the documentation tools come from requirements-dev.txt")

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _hook(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", DOCS / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _png() -> bytes:
    """A valid 1 x 1 grey PNG, standing in for a plot not drawn yet."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\x80")) + chunk(b"IEND", b""))


def _expected_plots() -> list[str]:
    return _hook("benchmarks")._PLOT.findall((DOCS / "benchmarks.md").read_text())


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    plots = tmp_path_factory.mktemp("plots")
    real = ROOT / "benchmarks" / "plots"
    for png in real.glob("*.png"):
        shutil.copy(png, plots)
    for name, _ in _expected_plots():
        if not (plots / name).exists():
            (plots / name).write_bytes(_png())
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PSRT_DOCS_PLOTS": str(plots), "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
    if done.returncode != 0:
        warnings = "\n".join(line for line in done.stderr.splitlines() if not line.startswith("INFO"))
        pytest.fail(f"mkdocs build --strict failed:\n{warnings[-4000:]}")
    return out


def _page(site: Path, path: str) -> str:
    return (site / path / "index.html").read_text()


def _text(page: str) -> str:
    """What a reader sees of a page's article."""
    article = re.search(r"<article[^>]*>(.*)</article>", page, re.DOTALL).group(1)
    return html.unescape(re.sub(r"<[^>]+>", "", article))


def test_site_builds_with_strict(site):
    assert (site / "index.html").exists()


def test_configuration_page_lists_every_config_field(site):
    from psrt.config import _ENV_NAMES, Config

    text = _text(_page(site, "reference/configuration"))
    for field in fields(Config):
        for name in _ENV_NAMES[field.name]:
            assert name in text, f"Config.{field.name}: {name} is not on the configuration page"


def _options(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string of ``parser`` but ``-h``/``--help``."""
    return [option for action in parser._actions if not isinstance(action, argparse._HelpAction)
            for option in action.option_strings]


def test_psrun_page_lists_every_option(site):
    from launcher.cli import make_parser

    text = _text(_page(site, "reference/psrun"))
    missing = [option for option in _options(make_parser()) if option not in text]
    assert not missing, f"psrun options missing from its reference page: {missing}"


def test_psrun_page_is_generated_without_torch():
    """The psrun page comes from launcher.cli's parser, which must stay light to import."""
    probe = "import sys, launcher.cli; launcher.cli.make_parser(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.stdout.strip() == "False", done.stderr or "importing launcher.cli imported torch"


def test_psrt_page_lists_every_subcommand_and_option(site):
    from psrt.cli import make_parser

    text = _text(_page(site, "reference/psrt-cli"))
    commands = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in commands.choices.items():
        assert f"psrt {name}" in text, f"psrt {name} is not on the psrt command's page"
        missing = [option for option in _options(sub) if option not in text]
        assert not missing, f"psrt {name} options missing from its reference page: {missing}"


def _error_classes() -> list[str]:
    tree = ast.parse((ROOT / "psrt" / "errors.py").read_text())
    return [node.name for node in tree.body if isinstance(node, ast.ClassDef)]


def test_every_error_class_has_a_troubleshooting_entry(site):
    guide = (DOCS / "guides" / "troubleshooting.md").read_text()
    page = _page(site, "guides/troubleshooting")
    for name in _error_classes():
        assert re.search(rf"^### `{name}`$", guide, re.MULTILINE), \
            f"psrt.errors.{name} has no '### `{name}`' entry in docs/guides/troubleshooting.md"
        assert f'id="{name.lower()}"' in page, f"the troubleshooting entry of {name} has no #{name.lower()} anchor"


def _public_names(namespace: str) -> list[str] | None:
    """``__all__`` of a namespace on the API page (else its public classes and functions);
    None where the target is not a module of its own (a single object)."""
    base = ROOT / namespace.replace(".", "/")
    source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    if not source.exists():
        return None
    tree = ast.parse(source.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "__all__":
            return list(ast.literal_eval(node.value))
    return [node.name for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")]


def _is_module_of(namespace: str, name: str) -> bool:
    """Whether ``namespace`` exports ``name`` as a module (``from psrt.torch import elastic``)."""
    base = ROOT / namespace.replace(".", "/")
    source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    return any(isinstance(node, ast.ImportFrom) and node.module == namespace and name in [a.name for a in node.names]
               for node in ast.walk(ast.parse(source.read_text())))


def test_api_page_documents_every_public_name(site):
    """Every name a public namespace exports is on the API page: under its own path, under
    the heading given to it where Griffe cannot see it, or as a member of a documented class
    (``hvd.Average`` is ``ReduceOp.Average``).  Modules exported as names are namespaces."""
    page = _page(site, "reference/api")
    ids = set(re.findall(r'id="(psrt[\w.]*)"', page))
    headings = {_text(f"<article>{h}</article>").strip().rstrip("¶").strip()
                for h in re.findall(r'<h\d id="psrt[\w.]*" class="doc doc-heading">(.*?)</h\d>', page, re.DOTALL)}
    targets = re.findall(r"^::: (psrt[\w.]*)$", (DOCS / "reference" / "api.md").read_text(), re.MULTILINE)
    missing = []
    for namespace in targets:
        for name in _public_names(namespace) or ():
            path = f"{namespace}.{name}"
            as_member = any(i.startswith(f"{namespace}.") and i.endswith(f".{name}")
                            and i.count(".") == path.count(".") + 1 for i in ids)
            if path not in ids and path not in headings and not as_member and not _is_module_of(namespace, name):
                missing.append(path)
    assert not missing, f"public names missing from the API page: {missing}"


def test_every_benchmark_plot_is_copied_and_shown(site):
    page = _page(site, "benchmarks")
    for name, _ in _expected_plots():
        assert (site / "benchmarks" / "plots" / name).exists(), f"{name} was not copied into the site"
        assert f'src="plots/{name}"' in page, f"{name} is not shown on the benchmarks page"


def test_a_plot_not_drawn_yet_is_a_note_not_a_broken_link():
    hook = _hook("benchmarks")

    class NoFiles:
        def get_file_from_path(self, path):
            return None

    note = hook._plot("dp_scaling.png", "Throughput", "", NoFiles())
    assert "has not been drawn" in note and "](" not in note


def _signatures(page: str) -> dict[str, str]:
    """Each documented object's signature on an API page, as a reader sees it, by anchor."""
    found = {}
    for anchor, code in re.findall(r'<h\d id="(psrt[\w.]*)" class="doc doc-heading">(?:(?!</h\d>).)*</h\d>\s*'
                                   r'<div class="doc-signature highlight"><pre><span></span><code>(.*?)</code></pre>',
                                   page, re.DOTALL):
        found[anchor] = html.unescape(re.sub(r"<[^>]+>", "", code)).rstrip("\n")
    return found


def test_api_page_wraps_long_signatures(site):
    """mkdocstrings formats signatures with ruff (requirements-dev.txt): a long one is wrapped one
    parameter a line, and none is wider than the configured line_length."""
    configured = re.search(r"^\s*line_length: (\d+)", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE)
    width = int(configured.group(1)) if configured else 60  # mkdocstrings' default
    signatures = _signatures(_page(site, "reference/api"))
    for anchor in ("psrt.torch.allreduce", "psrt.torch.DistributedOptimizer", "psrt.zero.ZeroOptimizer",
                   "psrt.pp.Pipeline"):
        assert anchor in signatures, f"{anchor} shows no signature (a class shows its __init__'s)"
        lines = signatures[anchor].splitlines()
        assert len(lines) > 3 and lines[-1].startswith(")"), f"{anchor}'s signature is not wrapped:\n{signatures[anchor]}"
    wide = [f"{anchor}: {line}" for anchor, text in signatures.items() for line in text.splitlines()
            if len(line) > width]
    assert not wide, f"signature lines wider than {width} columns on the API page:\n" + "\n".join(wide[:10])


def test_readme_and_cluster_guide_show_the_sbatch_script_the_slurm_tests_submit():
    script = (ROOT / "examples" / "slurm" / "psrun.sbatch").read_text()
    for page in (ROOT / "README.md", ROOT / "docs" / "guides" / "cluster.md"):
        assert f"```bash\n{script}```" in page.read_text(), f"{page.name} does not show {script!r} as it is"


def test_torch_guide_says_every_torchrun_variable_psrt_sets_and_where_it_comes_from():
    from launcher.contract import TORCH_RANK_VARIABLES, TORCH_VARIABLE_NAMES
    from psrt.rank_env import _SLURM

    guide = (DOCS / "guides" / "torch-distributed.md").read_text()
    sources = [source for _, names in TORCH_RANK_VARIABLES for source in names] + list(_SLURM.values())
    missing = [name for name in (*TORCH_VARIABLE_NAMES, *sources) if f"`{name}`" not in guide]
    assert not missing, f"the torch.distributed guide does not name {missing}"
