"""Allreduces on a host every rank takes as crowded (``PSRT_WAITS=nap``'s verdict, set on
every rank at once): large ones agree to go by MPI's non-blocking call waited for by
napping, and the ring's exchanges nap, and each gives the same sums as on an idle host."""
from __future__ import annotations

import torch
import torch.distributed as dist

import psrt.comm.paced
import psrt.comm.ring
import psrt.torch as hvd
from _harness import Checks
from _reference import DTYPES, check_reduced, samples
from psrt.comm import crowding

# Enough large calls of one communicator to pass an agreement and run napping after it.
CALLS = 2 * psrt.comm.paced.Pace.AGREE_EVERY + 1


def crowded_allreduces_nap_and_agree(key: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    naps = {"paced": 0, "ring": 0}

    def counted(module, where):
        plain = module.wait_politely

        def wait(request):
            naps[where] += 1
            plain(request)
        return plain, wait

    plain_paced, psrt.comm.paced.wait_politely = counted(psrt.comm.paced, "paced")
    plain_ring, psrt.comm.ring.wait_politely = counted(psrt.comm.ring, "ring")
    crowding.configure("nap")
    try:
        for call in range(CALLS):  # one name, one shape: the express path's repeated allreduce
            inputs = samples(f"{key}/{call % 3}", size, DTYPES["float32"], (96, 257))
            got = hvd.allreduce(inputs[rank].clone(), op=hvd.Sum, name=f"{key}/express")
            check_reduced(got, inputs, "Sum", f"{key} call {call}")
        if dist.is_initialized():
            tensor = torch.ones(70_000) * (rank + 1)
            dist.all_reduce(tensor)
            assert torch.equal(tensor, torch.full((70_000,), float(size * (size + 1) // 2))), key
    finally:
        crowding.configure("auto")
        psrt.comm.paced.wait_politely, psrt.comm.ring.wait_politely = plain_paced, plain_ring
    assert naps["paced"] + naps["ring"] > 0, f"{key}: no large allreduce napped ({naps})"


def add_checks(checks: Checks) -> None:
    checks.add("waits/crowded_allreduces_nap_and_agree", crowded_allreduces_nap_and_agree)
