"""psrt's import graph follows its layers: no module imports one of a higher layer, no two
packages import each other through any chain, and psrt takes nothing from the launcher but
the contract between psrun and its ranks.

This file is where psrt's layers are written down (:data:`LAYERS`, bottom-up, each with why
it sits where it does).  The graph is grimp's (the library behind import-linter), built from
the source, so an import inside a function counts as much as one at the top of a module: a
lazy import only hides a dependency from the interpreter, not from the design.
"""
from __future__ import annotations

import ast
import itertools
import pathlib

import grimp
import pytest

import psrt

# The layers, bottom-up: the transport and the direct layer beside it, the topology, the
# engine, the runtime, the framework binding, then the model families and the strategies built
# on it, and what combines strategies at the top.  A module may import its own layer and the
# ones below, never one above.  Each line says why it sits where it does.
LAYERS: list[tuple[str, ...]] = [
    # leaves every layer uses: errors, the typed configuration, small tensor and file helpers
    ("psrt.errors", "psrt.config", "psrt.autograd", "psrt.checkpoint",
     "psrt.probe_job", "psrt.stateful"),
    # transport and the direct layer beside it: the only place that touches mpi4py or cupy
    ("psrt.comm",),
    # world, local and cross groups, process sets and their direct groups
    ("psrt.topology",),
    # the Horovod-style background engine
    ("psrt.engine",),
    # the runtime object that holds configuration, topology and engine (and what it exports), and
    # the background checkpoint writers it holds until shutdown (each agrees over a direct group
    # of its own)
    ("psrt.runtime", "psrt.rank_env", "psrt.background_save"),
    # the DP x CP x TP x PP grid, built from a runtime's topology
    ("psrt.grid",),
    # how gradients travel: the bucket planner and the gradient reducer under every data-parallel
    # strategy (DistributedOptimizer, ZeRO, the parameter server), which say what a bucket's
    # communication is
    ("psrt.dp",),
    # the framework binding: the Horovod-shaped torch API and the torch.distributed backend
    ("psrt.torch",),
    # model families, their TP plans and pipeline stage layouts, and the vocabularies those are
    # written in (psrt.models.tp_styles, psrt.models.stage_layout): values for the generic machinery
    ("psrt.models",),
    # parallelism strategies, built on the torch API and the topology (TP and PP apply the
    # families' plans and layouts)
    ("psrt.zero", "psrt.ps", "psrt.tp", "psrt.pp", "psrt.cp", "psrt.ep"),
    # what combines strategies: elastic training, full state, pretrained weights, plans, tuning, the
    # psrt command and its offline subcommands (a timeline's summary)
    ("psrt.elastic", "psrt.full_state", "psrt.pretrained", "psrt.plan", "psrt.tune_command", "psrt.cli",
     "psrt.timeline_summary"),
]
# Imports up a layer that the design accepts, each with its reason (none today: ``hvd.elastic``,
# Horovod's name for psrt.elastic, is resolved by name on first use, psrt.torch's code never
# uses it).
ACCEPTED_UPWARD: set[tuple[str, str]] = set()
# What psrt may import of the launcher: the names and lines psrun and the ranks share, which
# import nothing themselves (psrun must start without torch or MPI).
LAUNCHER_CONTRACT = "launcher.contract"


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("psrt")


def _layer_of(module: str) -> int | None:
    """The layer of ``module``: that of the longest name it falls under (``psrt.torch.c10d``
    before ``psrt.torch``); None for the root package, which only re-exports."""
    best, level = -1, None
    for index, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, level = len(name), index
    return level


def _package(module: str) -> str:
    """``psrt.models`` for ``psrt.models.tp_styles``; ``psrt.torch`` for ``psrt.torch.c10d``."""
    return ".".join(module.split(".")[:2])


def _edges(graph: grimp.ImportGraph):
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            yield importer, imported


def _where(graph: grimp.ImportGraph, importer: str, imported: str) -> str:
    lines = sorted(d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported))
    return f"{importer} -> {imported} (line {', '.join(map(str, lines))})"


def test_every_module_has_a_layer(graph):
    unplaced = sorted(m for m in graph.modules if m != "psrt" and _layer_of(m) is None)
    assert not unplaced, f"modules in no layer of LAYERS (add them where they belong): {unplaced}"


def test_no_module_imports_a_higher_layer(graph):
    upward = [_where(graph, importer, imported) for importer, imported in _edges(graph)
              if imported != "psrt" and importer != "psrt" and _layer_of(importer) < _layer_of(imported)
              and (importer, imported) not in ACCEPTED_UPWARD]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_two_packages_import_each_other(graph):
    """A circle between packages (``psrt.a`` imports ``psrt.b``, which imports ``psrt.a`` back
    through any chain) makes neither of them a layer: each needs the other to be understood."""
    packages = sorted({_package(m) for m in graph.modules if m != "psrt"})
    circles = []
    for first, second in itertools.combinations(packages, 2):
        there = graph.find_shortest_chain(importer=first, imported=second, as_packages=True)
        back = graph.find_shortest_chain(importer=second, imported=first, as_packages=True)
        if there and back:
            circles.append(f"{first} <-> {second}: {' -> '.join(there)}; back: {' -> '.join(back)}")
    assert not circles, "packages that import each other:\n" + "\n".join(circles)


def test_psrt_takes_only_the_contract_from_the_launcher_and_the_launcher_nothing_from_psrt():
    both = grimp.build_graph("psrt", "launcher")
    crossing = [_where(both, importer, imported) for importer, imported in _edges(both)
                if (importer.startswith("psrt") and imported.startswith("launcher") and imported != LAUNCHER_CONTRACT)
                or (importer.startswith("launcher") and imported.startswith("psrt"))]
    assert not crossing, "imports between psrt and the launcher other than the contract:\n" + "\n".join(crossing)


def test_no_package_imports_another_packages_private_names(graph):
    """A name with a leading underscore (a module or what a module defines) is its package's
    own: another package that needs it needs a public interface instead."""
    root = pathlib.Path(psrt.__file__).parent
    private = []
    for importer, imported in _edges(graph):
        if _package(importer) != _package(imported) and any(p.startswith("_") for p in imported.split(".")):
            private.append(_where(graph, importer, imported))
    for path in sorted(root.rglob("*.py")):
        module = ".".join(("psrt", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("psrt") \
                    and _package(node.module) != _package(module):
                names = [alias.name for alias in node.names if alias.name.startswith("_")]
                if names:
                    private.append(f"{module} imports {', '.join(names)} from {node.module} (line {node.lineno})")
    assert not private, "imports of another package's private names:\n" + "\n".join(private)
