"""The paper's mechanism: parallel layout, conjugate operators, parallel layers, cross-entropy, RNG."""

from shardlm.parallel.comm import CommStats, Communicator
from shardlm.parallel.cross_entropy import vocab_parallel_cross_entropy
from shardlm.parallel.layers import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, VocabParallelEmbedding
from shardlm.parallel.layout import ParallelContext, check_layout, init_distributed
from shardlm.parallel.mappings import (
    copy_to_tensor_parallel,
    gather_from_sequence_parallel,
    gather_from_tensor_parallel,
    gather_zigzag_rows,
    reduce_from_tensor_parallel,
    reduce_scatter_to_sequence_parallel,
    scatter_to_sequence_parallel,
    scatter_to_tensor_parallel,
    sum_over,
)
from shardlm.parallel.random import RNGStatesTracker, seed_model_parallel

__all__ = [
    "ColumnParallelLinear", "CommStats", "Communicator", "ParallelContext", "RNGStatesTracker",
    "ReplicatedLinear", "RowParallelLinear", "VocabParallelEmbedding", "check_layout", "copy_to_tensor_parallel",
    "gather_from_sequence_parallel", "gather_from_tensor_parallel", "gather_zigzag_rows", "init_distributed",
    "reduce_from_tensor_parallel", "reduce_scatter_to_sequence_parallel", "scatter_to_sequence_parallel",
    "scatter_to_tensor_parallel", "seed_model_parallel", "sum_over", "vocab_parallel_cross_entropy",
]
