"""The API reference says what a user must know to call psrt correctly.

1. Every public call that communicates says, in one sentence of its docstring, that it is
   collective: which ranks call it and that they call it in the same order ("Collective:
   every rank of ``process_set`` calls it, in the same order.").  A rank that skips such a
   call leaves the others waiting, and psrt's deadlock report then names it "X() is
   collective: call it on every rank"; the reference must have said so first.  Every public
   callable is classified below as collective or local, so a new one fails this test until
   someone decides which it is (and a collective one says so).
2. The main calls document every argument (a ``:param name:`` line per parameter of the
   signature, and none that the signature lacks).

Docstrings are read with Griffe, as mkdocstrings reads them for the site, so what is checked
is what the reference shows (an attribute's docstring included); callables and signatures are
read from the imported objects.
"""
from __future__ import annotations

import importlib
import inspect
import re
from functools import cache
from pathlib import Path

import pytest

griffe = pytest.importorskip("griffe", reason="the documentation tools come from requirements-dev.txt")

ROOT = Path(__file__).resolve().parents[2]

# -- what communicates ---------------------------------------------------------------------------
# A class's own entry is its construction; ``X.forward`` is a module run through ``module(x)``,
# whose docstring is the class's.  Public paths, as the API reference shows them.
COLLECTIVE = {
    "psrt.init", "psrt.shutdown", "psrt.add_process_set", "psrt.remove_process_set",
    # psrt.torch (hvd)
    "psrt.torch.allreduce", "psrt.torch.allreduce_", "psrt.torch.allreduce_async", "psrt.torch.allreduce_async_",
    "psrt.torch.grouped_allreduce", "psrt.torch.grouped_allreduce_", "psrt.torch.grouped_allreduce_async",
    "psrt.torch.grouped_allreduce_async_", "psrt.torch.sparse_allreduce_async",
    "psrt.torch.allgather", "psrt.torch.allgather_async", "psrt.torch.allgather_into_async",
    "psrt.torch.grouped_allgather", "psrt.torch.grouped_allgather_async",
    "psrt.torch.alltoall", "psrt.torch.alltoall_async", "psrt.torch.barrier", "psrt.torch.process_group",
    "psrt.torch.broadcast", "psrt.torch.broadcast_", "psrt.torch.broadcast_async", "psrt.torch.broadcast_async_",
    "psrt.torch.reducescatter", "psrt.torch.reducescatter_async", "psrt.torch.grouped_reducescatter",
    "psrt.torch.grouped_reducescatter_async",
    "psrt.torch.allgather_object", "psrt.torch.broadcast_object", "psrt.torch.broadcast_optimizer_state",
    "psrt.torch.broadcast_parameters", "psrt.torch.join",
    "psrt.torch.DistributedOptimizer", "psrt.torch.SyncBatchNorm.forward",
    # psrt.ps
    "psrt.ps.serve", "psrt.ps.DistributedOptimizer", "psrt.ps.KVStore", "psrt.ps.KVStore.init",
    "psrt.ps.KVStore.push", "psrt.ps.KVStore.pull", "psrt.ps.KVStore.push_pull", "psrt.ps.KVStore.push_async",
    "psrt.ps.KVStore.pull_async", "psrt.ps.KVStore.push_pull_async", "psrt.ps.KVStore.save", "psrt.ps.KVStore.load",
    "psrt.ps.KVStore.restore",
    # psrt.zero
    "psrt.zero.ZeroOptimizer", "psrt.zero.ZeroOptimizer.step", "psrt.zero.ZeroOptimizer.synchronize",
    "psrt.zero.ZeroOptimizer.clip_grad_norm_", "psrt.zero.ZeroOptimizer.save", "psrt.zero.ZeroOptimizer.load",
    "psrt.zero.ZeroOptimizer.gathered_parameters", "psrt.zero.save", "psrt.zero.load", "psrt.zero.wrap",
    "psrt.zero.dcp.set_model_state_dict", "psrt.zero.dcp.ModelState.load_state_dict",
    # psrt.grid
    "psrt.grid.ProcessGrid", "psrt.grid.ProcessGrid.free",
    # psrt.tp
    "psrt.tp.ColumnParallelLinear.forward", "psrt.tp.RowParallelLinear.forward",
    "psrt.tp.VocabParallelEmbedding.forward", "psrt.tp.LayerNorm.forward", "psrt.tp.ParallelMLP.forward",
    "psrt.tp.ParallelSelfAttention.forward", "psrt.tp.ParallelSelfAttention.core",
    "psrt.tp.ParallelTransformerBlock.forward", "psrt.tp.copy_to_tensor_parallel_region",
    "psrt.tp.reduce_from_tensor_parallel_region", "psrt.tp.scatter_to_tensor_parallel_region",
    "psrt.tp.gather_from_tensor_parallel_region", "psrt.tp.scatter_to_sequence_parallel_region",
    "psrt.tp.gather_from_sequence_parallel_region", "psrt.tp.reduce_scatter_to_sequence_parallel_region",
    "psrt.tp.sequence_parallel_parameters", "psrt.tp.vocab_parallel_cross_entropy", "psrt.tp.full_state_dict",
    # psrt.cp, psrt.ep, psrt.pp, psrt.full_state
    "psrt.cp.ring_attention", "psrt.ep.MoE.forward", "psrt.ep.all_to_all", "psrt.pp.Pipeline.step",
    "psrt.full_state.full_state_dict", "psrt.full_state.full_optimizer_state_dict",
    "psrt.full_state.FullState.state_dict", "psrt.pretrained.save_pretrained",
    "psrt.stateful.ShardedStateful.save", "psrt.stateful.ShardedStateful.load",
    # psrt.elastic
    "psrt.elastic.run", "psrt.elastic.State.commit", "psrt.elastic.State.check_host_updates",
    "psrt.elastic.State.sync", "psrt.elastic.ObjectState.sync", "psrt.elastic.TorchState.sync",
    "psrt.elastic.TorchState.restore",
}

# Calls that never wait for another rank (some send a request to the parameter servers that no
# other worker has to match).
LOCAL = {
    "psrt.ProcessSet", "psrt.ProcessSet.included", "psrt.ProcessSet.size", "psrt.ProcessSet.rank",
    "psrt.cross_rank", "psrt.cross_size", "psrt.is_initialized", "psrt.local_rank", "psrt.local_size", "psrt.rank",
    "psrt.size", "psrt.tuning_table",
    "psrt.torch.SyncBatchNorm", "psrt.torch.ccl_built", "psrt.torch.cuda_built", "psrt.torch.gloo_built",
    "psrt.torch.gloo_enabled", "psrt.torch.mpi_built", "psrt.torch.mpi_enabled", "psrt.torch.mpi_threads_supported",
    "psrt.torch.nccl_built", "psrt.torch.rocm_built", "psrt.torch.poll", "psrt.torch.synchronize",
    "psrt.torch.start_timeline", "psrt.torch.stop_timeline",
    "psrt.ps.num_servers", "psrt.ps.num_workers", "psrt.ps.role", "psrt.ps.worker_rank", "psrt.ps.KVStore.keys",
    "psrt.ps.KVStore.set_optimizer", "psrt.ps.KVStore.set_learning_rate", "psrt.ps.KVStore.stats",
    "psrt.ps.KVStore.close",
    "psrt.zero.ZeroOptimizer.zero_grad", "psrt.zero.ZeroOptimizer.scale_loss",
    "psrt.zero.ZeroOptimizer.unsharded_state_dict", "psrt.zero.ZeroOptimizer.memory_report",
    "psrt.zero.consolidate", "psrt.zero.expected_bytes",
    "psrt.zero.dcp.FlatRangeShard", "psrt.zero.dcp.FlatRangeShard.local_views",
    "psrt.zero.dcp.FlatRangeShard.is_view_of", "psrt.zero.dcp.ModelState",
    "psrt.zero.dcp.ModelState.state_dict", "psrt.zero.dcp.OptimizerState", "psrt.zero.dcp.OptimizerState.state_dict",
    "psrt.zero.dcp.OptimizerState.load_state_dict", "psrt.zero.dcp.get_model_state_dict",
    "psrt.zero.dcp.get_optimizer_state_dict", "psrt.zero.dcp.set_optimizer_state_dict",
    "psrt.grid.ProcessGrid.world_rank", "psrt.grid.world_groups",
    "psrt.tp.ColumnParallelLinear", "psrt.tp.RowParallelLinear", "psrt.tp.VocabParallelEmbedding",
    "psrt.tp.LayerNorm", "psrt.tp.ParallelMLP", "psrt.tp.ParallelSelfAttention", "psrt.tp.ParallelTransformerBlock",
    "psrt.tp.checkpoint", "psrt.tp.load_full_state_dict", "psrt.tp.manual_seed", "psrt.tp.replicated_dropout",
    "psrt.tp.rng_tracker", "psrt.tp.stats", "psrt.tp.tensor_parallel_dropout",
    "psrt.cp.check_length", "psrt.cp.positions", "psrt.cp.split", "psrt.cp.stats", "psrt.cp.unsplit",
    "psrt.ep.MoE", "psrt.ep.expert_parameters", "psrt.ep.stats",
    "psrt.pp.Pipeline", "psrt.pp.PipelineStage", "psrt.pp.PipelineStage.run_chunk", "psrt.pp.PipelineStage.forward",
    "psrt.pp.PipelineStage.is_first", "psrt.pp.PipelineStage.is_last", "psrt.pp.balanced_split",
    "psrt.pp.bubble_fraction", "psrt.pp.build", "psrt.pp.check", "psrt.pp.explicit_split", "psrt.pp.gpipe",
    "psrt.pp.in_flight", "psrt.pp.interleaved_one_f_one_b", "psrt.pp.makespan", "psrt.pp.one_f_one_b",
    "psrt.pp.render", "psrt.pp.simulate", "psrt.pp.zero_bubble_h1",
    "psrt.full_state.load_full_state_dict", "psrt.full_state.load_full_optimizer_state_dict",
    "psrt.full_state.groups_by_position",
    "psrt.full_state.FullState", "psrt.full_state.FullState.load_state_dict", "psrt.pretrained.load_pretrained",
    "psrt.stateful.Stateful", "psrt.stateful.Stateful.state_dict", "psrt.stateful.Stateful.load_state_dict",
    "psrt.stateful.ShardedStateful",
    "psrt.tp.parallelize", "psrt.pp.split", "psrt.pp.SplitStage",
    "psrt.elastic.ElasticSampler", "psrt.elastic.ElasticSampler.set_epoch", "psrt.elastic.ElasticSampler.reset",
    "psrt.elastic.ElasticSampler.record_batch", "psrt.elastic.ElasticSampler.record_indices",
    "psrt.elastic.ElasticSampler.get_indices", "psrt.elastic.ElasticSampler.state_dict",
    "psrt.elastic.ElasticSampler.load_state_dict", "psrt.elastic.State", "psrt.elastic.State.register_reset_callbacks",
    "psrt.elastic.State.on_reset", "psrt.elastic.State.save", "psrt.elastic.State.restore", "psrt.elastic.State.wait",
    "psrt.elastic.ObjectState", "psrt.background_save.SaveHandle", "psrt.background_save.SaveHandle.done",
    "psrt.background_save.SaveHandle.error", "psrt.background_save.SaveHandle.wait",
    "psrt.background_save.SaveHandle.result",
    "psrt.elastic.ObjectState.save", "psrt.elastic.ObjectState.restore", "psrt.elastic.TorchState",
    "psrt.elastic.TorchState.save", "psrt.elastic.plan_batch",
    "psrt.plan.default_machine", "psrt.plan.describe", "psrt.plan.evaluate", "psrt.plan.from_config",
    "psrt.plan.from_module", "psrt.plan.from_hf_config", "psrt.plan.layouts", "psrt.plan.load_machine", "psrt.plan.precision", "psrt.plan.table",
}

# Types of plain values (descriptions, plans, statistics): they and all their methods are local.
LOCAL_TYPES = {
    "psrt.torch.Bucketing", "psrt.torch.Compression", "psrt.torch.ReduceOp", "psrt.ps.Handle",
    "psrt.zero.ParamInfo", "psrt.zero.Partition", "psrt.zero.Piece", "psrt.grid.Axis", "psrt.grid.Coordinates",
    "psrt.grid.GridShape", "psrt.tp.CommStats", "psrt.tp.RNGStatesTracker", "psrt.tp.Sharding", "psrt.pp.Action",
    "psrt.pp.Event", "psrt.pp.Op", "psrt.pp.StepProfile", "psrt.elastic.BatchPlan", "psrt.plan.Layout",
    "psrt.plan.Link", "psrt.plan.Machine", "psrt.plan.MemoryBreakdown", "psrt.plan.ParameterBlocks", "psrt.plan.Plan",
    "psrt.plan.Precision", "psrt.plan.StepTime", "psrt.plan.Transformer", "psrt.tp.ColumnWise", "psrt.tp.RowWise",
    "psrt.tp.VocabEmbedding", "psrt.tp.SequenceParallel", "psrt.tp.SequenceScatter", "psrt.tp.SequenceGather",
    "psrt.tp.Replicated", "psrt.tp.TensorParallelism", "psrt.pp.StageLayout", "psrt.pretrained.LoadReport",
}

#: The sentence: "Collective: every rank of X calls it, in the same order." (or "Collective in
#: training mode: ...", "... every worker ...", "... runs forward and backward through it ...").
_SENTENCE = re.compile(r"\bCollective(?: (?:in|with) [^:]{1,60})?: every (?:rank|worker)\b.{0,300}?"
                       r"\bin the same order\b", re.DOTALL)


# -- what the main calls take --------------------------------------------------------------------
_ALLREDUCE_FAMILY = ["allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
                     "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
                     "sparse_allreduce_async"]
MAIN_CALLS = [f"psrt.torch.{name}" for name in _ALLREDUCE_FAMILY] + [
    "psrt.torch.DistributedOptimizer", "psrt.ps.DistributedOptimizer",
    "psrt.zero.ZeroOptimizer", "psrt.zero.ZeroOptimizer.step", "psrt.zero.ZeroOptimizer.zero_grad",
    "psrt.zero.ZeroOptimizer.scale_loss", "psrt.zero.ZeroOptimizer.clip_grad_norm_", "psrt.zero.ZeroOptimizer.save",
    "psrt.zero.ZeroOptimizer.load",
    "psrt.ps.KVStore", "psrt.ps.KVStore.init", "psrt.ps.KVStore.push", "psrt.ps.KVStore.pull",
    "psrt.ps.KVStore.push_pull", "psrt.ps.KVStore.push_async", "psrt.ps.KVStore.pull_async",
    "psrt.ps.KVStore.push_pull_async", "psrt.ps.KVStore.set_optimizer", "psrt.ps.KVStore.set_learning_rate",
    "psrt.ps.KVStore.save", "psrt.ps.KVStore.load",
    "psrt.grid.ProcessGrid", "psrt.grid.ProcessGrid.world_rank",
    "psrt.pp.Pipeline", "psrt.pp.Pipeline.step",
]


# -- reading the code as the reference does --------------------------------------------------------
@cache
def _griffe_package():
    return griffe.load("psrt", search_paths=[str(ROOT)], resolve_aliases=True, resolve_external=False)


def _namespaces() -> list[str]:
    """The namespaces the API page documents (its ``::: psrt...`` lines that are modules)."""
    targets = re.findall(r"^::: (psrt[\w.]*)$", (ROOT / "docs" / "reference" / "api.md").read_text(), re.MULTILINE)
    return [t for t in targets if (ROOT / t.replace(".", "/")).is_dir() or (ROOT / f"{t.replace('.', '/')}.py").exists()]


def _exported(module) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [name for name, value in vars(module).items() if not name.startswith("_")
            and (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == module.__name__]


def _methods(cls: type) -> list[str]:
    """The public methods a class defines itself (what its section of the page lists)."""
    found = []
    for name, value in vars(cls).items():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if not name.startswith("_") and inspect.isfunction(value):
            found.append(name)
    return found


@cache
def public_callables() -> dict[str, object]:
    """Public path -> object, for every callable the public namespaces export and every public
    method of the classes among them; an object exported twice (``psrt.init`` is
    ``psrt.torch.init``) under its first path."""
    found: dict[str, object] = {}
    seen: set[int] = set()
    for namespace in _namespaces():
        module = importlib.import_module(namespace)
        for name in _exported(module):
            value = getattr(module, name)
            if inspect.ismodule(value) or not callable(value) or id(value) in seen:
                continue
            if inspect.isclass(value) and issubclass(value, BaseException):
                continue  # error classes: the troubleshooting guide covers them
            seen.add(id(value))
            path = f"{namespace}.{name}"
            found[path] = value
            if inspect.isclass(value):
                for method in _methods(value):
                    found[f"{path}.{method}"] = getattr(value, method)
    return found


def _resolve(path: str) -> object:
    """The object at a public path (``psrt.zero.ZeroOptimizer.step``)."""
    for cut in range(path.count("."), 0, -1):
        module_name, rest = path.rsplit(".", cut)[0], path.split(".")[-cut:]
        try:
            value = importlib.import_module(module_name)
        except ImportError:
            continue
        for part in rest:
            value = getattr(value, part)
        return value
    raise LookupError(path)


def _griffe_object(path: str, value: object):
    """The Griffe object the reference renders for the object at a public path: looked up where
    it is defined (a function whose module has its name, ``psrt.pp.simulate``, hides behind the
    module), else under the public path (a function made at run time and bound to a name)."""
    package = _griffe_package()
    qualname = getattr(value, "__qualname__", "")
    candidates = []
    if getattr(value, "__module__", "").startswith("psrt") and "<locals>" not in qualname:
        candidates.append(f"{value.__module__}.{qualname}")
    candidates.append(path)
    for candidate in candidates:
        try:
            found = package[candidate.split(".", 1)[1]]
        except KeyError:
            continue
        found = found.final_target if found.is_alias else found
        if not found.is_module:
            return found
    raise LookupError(f"Griffe finds no object for {path} (tried {candidates})")


def docstring(path: str) -> str:
    """What the reference shows as ``path``'s docstring (a forward method's is its class's)."""
    if path.endswith(".forward") and path in COLLECTIVE:
        path = path.rsplit(".", 1)[0]
    found = _griffe_object(path, _resolve(path))
    return found.docstring.value if found.docstring is not None else ""


def documented_params(path: str) -> list[str]:
    """The names of the ``:param name:`` lines of ``path``'s docstring, as the reference parses them."""
    found = _griffe_object(path, _resolve(path))
    if found.docstring is None:
        return []
    sections = found.docstring.parse("sphinx")
    return [param.name for section in sections if section.kind.value == "parameters" for param in section.value]


def signature_params(path: str) -> list[str]:
    """The parameters a caller passes (``self`` left out; ``*args``/``**kwargs`` by name)."""
    value = _resolve(path)
    parameters = list(inspect.signature(value).parameters.values())
    if not inspect.isclass(value) and "." in path and inspect.isclass(_resolve(path.rsplit(".", 1)[0])):
        parameters = parameters[1:]  # a method's self
    return [p.name for p in parameters]


# -- the tests -----------------------------------------------------------------------------------
def _covered_by_type(path: str) -> bool:
    return any(path == t or path.startswith(f"{t}.") for t in LOCAL_TYPES)


def test_every_public_callable_is_classified():
    """A new public call fails here until someone says whether it communicates."""
    public = public_callables()
    unclassified = [path for path in public if path not in COLLECTIVE and path not in LOCAL
                    and not _covered_by_type(path)]
    assert not unclassified, (
        f"classify these public callables in {Path(__file__).name}: COLLECTIVE if a call waits for other "
        f"ranks (and say so in its docstring), LOCAL if not: {unclassified}")
    both = sorted(COLLECTIVE & (LOCAL | {p for p in COLLECTIVE if _covered_by_type(p)}))
    assert not both, f"classified both collective and local: {both}"
    stale = sorted(path for path in COLLECTIVE | LOCAL | LOCAL_TYPES if path not in public)
    assert not stale, f"no longer public callables (remove them from the lists): {stale}"


@pytest.mark.parametrize("path", sorted(COLLECTIVE))
def test_collective_call_says_it_is_collective(path):
    text = " ".join(docstring(path).split())
    assert _SENTENCE.search(text), (
        f"{path}: its docstring (as the API reference shows it) must say which ranks call it and that they "
        f"call it in the same order, e.g. 'Collective: every rank of ``process_set`` calls it, in the same "
        f"order.'; it reads: {text[:300]!r}")


def test_the_sentence_check_catches_a_missing_sentence():
    """The check itself: a docstring without the sentence, or with half of it, fails."""
    assert _SENTENCE.search("Collective: every rank of ``process_set`` calls it, in the same order.")
    assert _SENTENCE.search('Collective in ``"sync"`` mode: every worker pushes each key once per step, in the '
                            "same order of steps.")
    assert not _SENTENCE.search("Reduce ``tensor`` over the process set.")
    assert not _SENTENCE.search("Save a sharded checkpoint (collective over the set).")
    assert not _SENTENCE.search("Collective: every rank of ``process_set`` calls it.")


@pytest.mark.parametrize("path", MAIN_CALLS)
def test_main_call_documents_every_argument(path):
    taken, documented = signature_params(path), documented_params(path)
    missing = [name for name in taken if name not in documented]
    assert not missing, f"{path}: arguments without a ':param name:' line in its docstring: {missing}"
    unknown = [name for name in documented if name not in taken]
    assert not unknown, f"{path}: ':param' lines for arguments it does not take: {unknown}"


@pytest.mark.parametrize("path", MAIN_CALLS)
def test_main_call_param_lines_say_something(path):
    found = _griffe_object(path, _resolve(path))
    sections = found.docstring.parse("sphinx") if found.docstring is not None else []
    empty = [param.name for section in sections if section.kind.value == "parameters"
             for param in section.value if len(param.description.split()) < 3]
    assert not empty, f"{path}: ':param' lines that say next to nothing: {empty}"
