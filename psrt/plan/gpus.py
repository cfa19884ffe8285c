"""Machine profiles of common GPU nodes, built from published figures: ``--machine a100``,
``--machine h100``, ``--machine h200``.

Each profile is a JSON file in ``psrt/plan/profiles/`` holding a node's figures (GPUs per
node, dense bf16 FLOP/s, memory, HBM, NVLink and InfiniBand bandwidths), each with its
source, and the fractions of those peaks that real kernels reach (measured on an H100, or
estimated, each saying which).  :func:`gpu_machine` turns them into the figures the cost
model reads:

* a matrix product runs at the peak times its size's fraction; attention at the peak times
  its head dimension's fraction;
* elementwise work moves each byte a block keeps 4 times (written and read forward, its
  gradient written and read backward) at the reachable HBM bandwidth; an AdamW step 28
  bytes per parameter (fp32 master, two moments read and written, the gradient read, the
  16-bit copy written); a copy reads and writes;
* a block's fixed cost is its kernels' launches; a TP block's extra cost is its 4
  collectives' latency;
* collectives inside a node run at NVLink's one-way bandwidth, across nodes at the NICs'
  (:meth:`psrt.plan.Machine.group_link`), both at the reachable fraction.

Compute and communication are still added, not overlapped (:mod:`psrt.plan.cost`).
"""
from __future__ import annotations

import json
import os

from psrt.errors import InvalidArgumentError
from psrt.plan.machine import Link, Machine, load_machine

_FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
#: Passes over each kept activation byte (see the module's docstring); AdamW's bytes per parameter.
_ELEMENTWISE_PASSES, _ADAMW_BYTES = 4, 28
_TP_COLLECTIVES_PER_BLOCK = 4


def names() -> list[str]:
    """The shipped profiles' names."""
    return sorted(name[:-5] for name in os.listdir(_FOLDER) if name.endswith(".json"))


def figures(name: str) -> dict:
    """The published and measured figures of the shipped profile ``name``, each as
    ``{"value": ..., "source": ...}``."""
    if name not in names():
        raise InvalidArgumentError(f"no shipped machine profile {name!r}; the shipped ones are {', '.join(names())}")
    with open(os.path.join(_FOLDER, f"{name}.json"), encoding="utf-8") as handle:
        return json.load(handle)


def gpu_machine(name: str) -> Machine:
    """The cost model's figures of one GPU of the shipped node ``name`` (a100, h100, h200)."""
    data = figures(name)
    value = {key: entry["value"] for key, entry in data.items() if isinstance(entry, dict)}
    peak, hbm = value["bf16_flops"], value["hbm_bandwidth"] * value["hbm_fraction"]
    launch = value["kernel_launch_s"]
    nvlink = Link(value["nvlink_latency_s"], value["nvlink_bandwidth"] / 2 * value["link_fraction"])
    nic = Link(value["ib_latency_s"], value["ib_bandwidth"] * value["link_fraction"])
    return Machine(
        name=f"{name} (published figures: {data['description']})",
        measured=False,
        matmul=tuple((n, fraction * peak) for n, fraction in value["matmul_fraction"]),
        attention=tuple((d, fraction * peak) for d, fraction in value["attention_fraction"]),
        layer_overhead_s=value["kernels_per_block"] * launch,
        tp_layer_overhead_s=_TP_COLLECTIVES_PER_BLOCK * nvlink.latency_s,
        sp_layer_overhead_s=_TP_COLLECTIVES_PER_BLOCK * nvlink.latency_s,
        elementwise_s_per_byte=_ELEMENTWISE_PASSES / hbm,
        engine_allreduce=nvlink, direct_allreduce=nvlink, p2p=nvlink,
        optimizer_s_per_param=_ADAMW_BYTES / hbm,
        memcpy_bandwidth=hbm / 2,
        ranks_per_node=int(value["gpus_per_node"]),
        inter_node=nic,
        memory_per_rank=int(value["memory"]),
        details={"sources": {key: entry["source"] for key, entry in data.items() if isinstance(entry, dict)}},
    )


def resolve(machine: str) -> Machine:
    """``--machine``'s argument: a shipped profile's name, else a profile file's path."""
    if machine in names():
        return gpu_machine(machine)
    if not os.path.isfile(machine):
        raise InvalidArgumentError(f"--machine {machine!r} is neither a shipped profile ({', '.join(names())}) nor "
                                   "a profile file (write one with `psrt plan --measure`)")
    return load_machine(machine)
