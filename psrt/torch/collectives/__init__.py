"""The collectives of the torch API, one module per family: ``allreduce``, ``allgather``,
``broadcast``, ``alltoall``, ``reducescatter`` and ``barrier``.

Each family's module holds every form of it (out-of-place, in-place, asynchronous,
grouped) and its autograd ``Function``: the out-of-place forms are differentiable, as
in Horovod, so changing a collective touches one file.  What the families share is in
:mod:`psrt.torch._common` (turning a call into engine work) and
:mod:`psrt.torch.collectives._differentiable` (autograd plumbing and the gradients).
"""
