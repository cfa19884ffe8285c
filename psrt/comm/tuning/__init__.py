"""Which algorithm carries a host allreduce or reduce-scatter of each size.

- :mod:`psrt.comm.tuning.table`: the tuning table, plain data (size bands and their
  algorithm, the key a table was measured for, its JSON file, the choice a call makes);
- :mod:`psrt.comm.tuning.measure`: measuring a job's table at ``psrt.init()``, and finding
  or writing its file.

The ``psrt tune`` command is :mod:`psrt.tune_command`; the fusion threshold and cycle time
are tuned on a job's own steps by :mod:`psrt.engine.autotune`, which is another matter.
"""
