"""The collectives of the torch API, one module per family: ``allreduce``, ``allgather``,
``broadcast``, ``alltoall``, ``reducescatter`` and ``barrier``.

Each family's module holds every form of it (out-of-place, in-place, asynchronous,
grouped) and its autograd ``Function`` (allreduce's grouped and sparse forms have a module of
their own, ``grouped_allreduce``): the out-of-place forms are differentiable, as in Horovod.  What the families share is in
:mod:`psrt.torch._common` (turning a call into engine work through its process set's channel) and
:mod:`psrt.torch.collectives._differentiable` (autograd plumbing and the gradients).
"""
