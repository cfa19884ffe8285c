"""Tensor parallelism (Megatron-style): layers split over a TP process set, the autograd
functions at the edges of their regions, sequence parallelism, the random streams of
dropout inside and outside TP regions, activation recomputation, and conversion to and
from a full single-process ``state_dict``."""
from psrt.tp.comm import CommStats, stats
from psrt.tp.cross_entropy import vocab_parallel_cross_entropy
from psrt.tp.rewrite import TensorParallelism, parallelize
from psrt.models.tp_styles import (ColumnWise, Replicated, RowWise, SequenceGather, SequenceParallel,
                                   SequenceScatter, VocabEmbedding)
from psrt.tp.layers import ColumnParallelLinear, LayerNorm, RowParallelLinear, VocabParallelEmbedding
from psrt.tp.random import (RNGStatesTracker, manual_seed, replicated_dropout, rng_tracker,
                            tensor_parallel_dropout)
from psrt.tp.recompute import checkpoint
from psrt.tp.regions import (copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
                             gather_from_tensor_parallel_region, reduce_from_tensor_parallel_region,
                             reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
                             scatter_to_tensor_parallel_region, sequence_parallel_parameters)
from psrt.tp.sharding import Sharding
from psrt.tp.state import full_state_dict, load_full_state_dict
from psrt.tp.transformer import ParallelMLP, ParallelSelfAttention, ParallelTransformerBlock

__all__ = [
    "ColumnParallelLinear", "ColumnWise", "CommStats", "LayerNorm", "ParallelMLP", "ParallelSelfAttention",
    "ParallelTransformerBlock", "RNGStatesTracker", "Replicated", "RowParallelLinear", "RowWise",
    "SequenceGather", "SequenceParallel", "SequenceScatter", "Sharding", "TensorParallelism", "VocabEmbedding",
    "VocabParallelEmbedding",
    "checkpoint", "copy_to_tensor_parallel_region", "full_state_dict", "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region", "load_full_state_dict", "manual_seed", "parallelize",
    "reduce_from_tensor_parallel_region", "reduce_scatter_to_sequence_parallel_region", "replicated_dropout",
    "rng_tracker", "scatter_to_sequence_parallel_region", "scatter_to_tensor_parallel_region",
    "sequence_parallel_parameters", "stats", "tensor_parallel_dropout", "vocab_parallel_cross_entropy",
]
