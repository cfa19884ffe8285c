"""How gradients travel in data parallelism: one folder.

:mod:`psrt.dp.buckets` plans which gradients share a bucket (sizes in bytes, for every
strategy); :mod:`psrt.dp.reducer` counts gradients as backward completes them and has a
strategy communicate each bucket: ``hvd.DistributedOptimizer`` averages it
(:mod:`psrt.torch.optimizer`), ``psrt.zero.ZeroOptimizer`` reduce-scatters it into shards,
``psrt.ps.DistributedOptimizer`` pushes it to the servers.  Each strategy is handed its
process set's engine channel (:mod:`psrt.engine.channel`) when built.
"""
from psrt.dp.buckets import (BUCKET_BYTES, FIRST_BUCKET_BYTES, Bucketing, PlannedBucket, Slot, overlap_pays,
                             plan_buckets, split_evenly)
from psrt.dp.reducer import (Bucket, BucketStrategy, GradientReducer, check_names, overlap_pays_here,
                             whole_buffer)

__all__ = ["BUCKET_BYTES", "FIRST_BUCKET_BYTES", "Bucket", "BucketStrategy", "Bucketing", "GradientReducer",
           "PlannedBucket", "Slot", "check_names", "overlap_pays", "overlap_pays_here", "plan_buckets",
           "split_evenly", "whole_buffer"]
