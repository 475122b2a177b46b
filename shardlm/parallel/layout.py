"""The parallel layout: which ranks form tensor-, data- and pipeline-parallel groups.

Ranks are arranged in a grid `arange(world).view(pipeline, data, tensor)` with the tensor dimension
innermost, so a tensor-parallel group is a run of consecutive ranks (inside one server, where the
fast links are), a data-parallel group takes the ranks at the same position of every
tensor-parallel group of one pipeline stage, and a pipeline group takes the ranks at the same
(data, tensor) position of every stage (the outermost dimension, so stages span servers). The first
and last rank of each pipeline group also form an "embedding" group, which sums the gradients of the
word embedding that both stages hold (input embedding and tied output layer).

Context parallelism (`parallel.context` = C) adds a dimension next to the tensor one, Megatron's order
`arange(world).view(pipeline, data, context, tensor)`: a context-parallel group takes the ranks at the
same tensor position of C consecutive TP groups, and every group above is then built within one
context position (for C = 1 they are exactly the groups of the three-dimensional grid). Parameters are
the same on every CP rank, so their gradients are reduced, and the distributed optimizer shards, over
the data x context group (`dp_cp`: the DP x C ranks of one (stage, tensor rank)). Expert parallelism
(`parallel.expert` = E) is carved out of those DP x C ranks, CP ranks first (see `ParallelContext`).

Everything is held by an explicit `ParallelContext` that is passed to layers and the trainer; there
are no module-level globals.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from shardlm.errors import UserError
from shardlm.parallel.comm import CommStats, Communicator
from shardlm.parallel.random import RNGStatesTracker, seed_model_parallel
from shardlm.parallel.shm import shared_memory_wanted
from shardlm.parallel.staged import STAGED, backend_for, backend_name


def check_layout(world_size: int, tensor_parallel: int, pipeline_parallel: int = 1, context_parallel: int = 1) -> int:
    """Validate the sizes and return the data-parallel size; raises UserError naming the numbers."""
    if tensor_parallel < 1 or pipeline_parallel < 1 or context_parallel < 1:
        raise UserError(
            f"parallel sizes must be >= 1 (tensor={tensor_parallel}, pipeline={pipeline_parallel}, "
            f"context={context_parallel})"
        )
    model_parallel = tensor_parallel * pipeline_parallel * context_parallel
    if world_size % model_parallel != 0:
        names, sizes = "tensor x pipeline", f"{tensor_parallel} x {pipeline_parallel}"
        if context_parallel > 1:
            names = "tensor x context x pipeline"
            sizes = f"{tensor_parallel} x {context_parallel} x {pipeline_parallel}"
        raise UserError(
            f"world size {world_size} is not divisible by {names} = {sizes}; use a world size that is a "
            f"multiple of {model_parallel}"
        )
    return world_size // model_parallel


def check_expert_layout(expert_parallel: int, data_parallel: int, context_parallel: int = 1) -> None:
    """Experts split over E ranks carved out of the data x context ranks: E must divide DP x C (UserError)."""
    ranks = data_parallel * context_parallel
    if expert_parallel < 1 or ranks % expert_parallel:
        where = f"data-parallel size {data_parallel}" if context_parallel == 1 else \
            f"data-parallel x context-parallel size {data_parallel} x {context_parallel} = {ranks}"
        raise UserError(f"parallel.expert={expert_parallel} does not divide the {where}; experts are split over "
                        "those ranks, so use an expert size that divides it")


def rank_grid(world_size: int, tensor_parallel: int, pipeline_parallel: int = 1) -> torch.Tensor:
    """Global ranks as a (pipeline, data, tensor) grid; TP groups are rows of consecutive ranks."""
    data_parallel = check_layout(world_size, tensor_parallel, pipeline_parallel)
    return torch.arange(world_size).view(pipeline_parallel, data_parallel, tensor_parallel)


def context_grid(world_size: int, tensor_parallel: int, pipeline_parallel: int = 1,
                 context_parallel: int = 1) -> torch.Tensor:
    """Global ranks as a (pipeline, data, context, tensor) grid; `grid[:, :, c, :]` is the three-dimensional
    grid of context position c (for C = 1, `rank_grid`'s)."""
    data_parallel = check_layout(world_size, tensor_parallel, pipeline_parallel, context_parallel)
    return torch.arange(world_size).view(pipeline_parallel, data_parallel, context_parallel, tensor_parallel)


def context_parallel_groups(grid: torch.Tensor) -> list[list[int]]:
    """Ranks of every context-parallel group of a (pipeline, data, context, tensor) grid (strided by TP)."""
    return grid.permute(0, 1, 3, 2).reshape(-1, grid.shape[2]).tolist()


def data_context_parallel_groups(grid: torch.Tensor) -> list[list[int]]:
    """Ranks of every data x context group of a (pipeline, data, context, tensor) grid: the DP x C ranks of one
    (stage, tensor rank), which hold the same parameters."""
    pp, dp, cp, tp = grid.shape
    return grid.permute(0, 3, 1, 2).reshape(-1, dp * cp).tolist()


def per_context_position(groups: Callable) -> Callable:
    """A group function of the (pipeline, data, tensor) grid applied to every context position of a
    (pipeline, data, context, tensor) grid."""
    return lambda grid: [ranks for c in range(grid.shape[2]) for ranks in groups(grid[:, :, c, :])]


def tensor_parallel_groups(grid: torch.Tensor) -> list[list[int]]:
    """Ranks of every tensor-parallel group (consecutive ranks)."""
    return grid.reshape(-1, grid.shape[2]).tolist()


def data_parallel_groups(grid: torch.Tensor) -> list[list[int]]:
    """Ranks of every data-parallel group (strided by the tensor-parallel size)."""
    return grid.permute(0, 2, 1).reshape(-1, grid.shape[1]).tolist()


def pipeline_parallel_groups(grid: torch.Tensor) -> list[list[int]]:
    """Ranks of every pipeline group, in stage order (strided by data x tensor)."""
    return grid.permute(1, 2, 0).reshape(-1, grid.shape[0]).tolist()


def expert_parallel_groups(grid: torch.Tensor, expert_parallel: int) -> list[list[int]]:
    """Ranks of every expert-parallel group of a (pipeline, data, context, tensor) grid: E consecutive ranks
    of one (stage, tensor rank)'s data x context ranks taken in (data, context) order, so EP runs over the
    CP ranks first, then over DP (Megatron's folding of EP over DP x CP)."""
    pp, dp, cp, tp = grid.shape
    return grid.permute(0, 3, 1, 2).reshape(pp, tp, dp * cp // expert_parallel, expert_parallel).reshape(
        -1, expert_parallel).tolist()


def expert_data_parallel_groups(grid: torch.Tensor, expert_parallel: int) -> list[list[int]]:
    """Ranks of every expert-data-parallel group of a (pipeline, data, context, tensor) grid: the DP x C / E
    data x context ranks of one (stage, tensor rank) that hold the same experts (the same position in their
    expert-parallel groups)."""
    pp, dp, cp, tp = grid.shape
    return grid.permute(0, 3, 1, 2).reshape(pp, tp, dp * cp // expert_parallel, expert_parallel).transpose(
        2, 3).reshape(-1, dp * cp // expert_parallel).tolist()


def embedding_groups(grid: torch.Tensor) -> list[list[int]]:
    """First and last stage of every pipeline group (one rank when there is one stage)."""
    return [sorted({ranks[0], ranks[-1]}) for ranks in pipeline_parallel_groups(grid)]


@dataclass
class ParallelContext:
    """Sizes, ranks, process groups and device of one rank, passed explicitly to every layer.

    `tp`, `dp` and `pp` are `Communicator`s over the tensor-, data- and pipeline-parallel groups,
    `embedding` over the first and last pipeline stage (see the module docstring), `world` over all
    ranks (barriers, run-wide flags); all record into the shared `comm` statistics. `pp.group` is
    also the group the pipeline's point-to-point transfers use (ranks of neighbouring stages).

    Expert parallelism (`parallel.expert` = E) folds into data x context parallelism (Megatron's
    folding): number the DP x C ranks of `dp_cp` d C + c (DP rank d, CP rank c); `ep` is a run of E
    consecutive ones (rank i has EP rank i % E: the CP ranks first, then DP), which split each MoE
    layer's experts; `expert_dp` the DP x C / E ranks holding the same experts (i, i + E, ...), over
    which expert gradients are reduced. With E = 1, `ep` has one rank and `expert_dp` is `dp_cp`.

    Only groups, ranks and the device live here: how layers use the groups (the MoE token dispatcher, the
    context-parallel K/V exchange) is a build argument of the model (`shardlm.models.config.ParallelOptions`).

    Context parallelism (`parallel.context` = C): `cp` is the group of C ranks that hold the zigzag parts
    of the same sequences (`shardlm.data.zigzag`), `dp_cp` the data x context group over which
    parameter gradients are reduced and the distributed optimizer shards. With C = 1, `cp` has one rank
    and `dp_cp` is `dp`.
    """

    rank: int
    world_size: int
    tp: Communicator
    dp: Communicator
    device: torch.device
    world: Communicator | None = None
    pp: Communicator | None = None
    embedding: Communicator | None = None
    comm: CommStats = field(default_factory=CommStats)
    rng: RNGStatesTracker | None = None
    ep: Communicator | None = None
    expert_dp: Communicator | None = None
    cp: Communicator | None = None
    dp_cp: Communicator | None = None

    def __post_init__(self):
        if self.pp is None:
            self.pp = Communicator("pp", None, 1, 0, self.comm)
        if self.embedding is None:
            self.embedding = Communicator("embedding", None, 1, 0, self.comm)
        if self.ep is None:
            self.ep = Communicator("ep", None, 1, 0, self.comm)
        if self.cp is None:
            self.cp = Communicator("cp", None, 1, 0, self.comm)
        if self.dp_cp is None:
            self.dp_cp = self.dp
        if self.expert_dp is None:
            self.expert_dp = self.dp_cp

    def seed(self, seed: int) -> RNGStatesTracker:
        """Seed this rank's generators (see `shardlm.parallel.random`) and keep the tracker. Pipeline
        stages seed their default generators differently (seed + 100 x stage), so their dropout masks are
        independent; stage 0 uses `seed` itself, as a run without pipeline parallelism does. Context-parallel
        ranks (other tokens of the same sequences) add 1000 x CP rank, for the same reason."""
        self.rng = seed_model_parallel(seed + 100 * self.pp_rank + 1000 * self.cp_rank, self.tp_rank, self.device)
        return self.rng

    @property
    def tp_size(self) -> int:
        return self.tp.size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank

    @property
    def dp_size(self) -> int:
        return self.dp.size

    @property
    def dp_rank(self) -> int:
        return self.dp.rank

    @property
    def cp_size(self) -> int:
        return self.cp.size

    @property
    def cp_rank(self) -> int:
        return self.cp.rank

    @property
    def ep_size(self) -> int:
        return self.ep.size

    @property
    def ep_rank(self) -> int:
        return self.ep.rank

    @property
    def pp_size(self) -> int:
        return self.pp.size

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline stage (its first one, with virtual stages)."""
        return self.pp.rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    def stage_rank(self, stage: int) -> int:
        """Global rank of pipeline stage `stage` at this rank's (data, tensor) position; stages out of
        range wrap around (the neighbours of interleaved virtual stages)."""
        stage %= self.pp.size
        return stage if self.pp.group is None else dist.get_global_rank(self.pp.group, stage)

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that logs and writes shared files."""
        return self.rank == 0

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> ParallelContext:
        """A one-process context (TP=1, DP=1) that needs no process group."""
        stats = CommStats()
        return cls(
            rank=0, world_size=1,
            tp=Communicator("tp", None, 1, 0, stats),
            dp=Communicator("dp", None, 1, 0, stats),
            device=torch.device(device), comm=stats,
            world=Communicator("world", None, 1, 0, stats),
        )

    @classmethod
    def from_process_group(cls, tensor_parallel: int, device: torch.device | None = None,
                           timeout_s: float | None = None, pipeline_parallel: int = 1,
                           expert_parallel: int = 1, context_parallel: int = 1) -> ParallelContext:
        """Build the TP, DP, PP, embedding, (with `expert_parallel` > 1) expert-parallel and
        expert-data-parallel, and (with `context_parallel` > 1) context and data x context groups on an
        initialized default process group.

        Every rank must call this with the same sizes, since `new_group` is collective.
        `timeout_s` bounds each collective on the new groups (default: torch's).
        """
        timeout = timedelta(seconds=timeout_s) if timeout_s else None
        device = device or default_device()
        shared_memory = shared_memory_wanted(device)
        world, rank = dist.get_world_size(), dist.get_rank()
        grid = context_grid(world, tensor_parallel, pipeline_parallel, context_parallel)
        stats = CommStats()
        mine = {}
        check_expert_layout(expert_parallel, grid.shape[1], context_parallel)
        kinds = (("tp", tensor_parallel_groups), ("dp", data_parallel_groups), ("pp", pipeline_parallel_groups),
                 ("embedding", embedding_groups))
        kinds = tuple((name, per_context_position(groups)) for name, groups in kinds) + (
            ("cp", context_parallel_groups), ("dp_cp", data_context_parallel_groups),
            ("ep", lambda g: expert_parallel_groups(g, expert_parallel)),
            ("expert_dp", lambda g: expert_data_parallel_groups(g, expert_parallel)))
        for name, groups in kinds:
            if name in ("pp", "embedding") and pipeline_parallel == 1:
                continue  # no pipeline: no groups to create (the defaults are size-1 communicators)
            if name in ("ep", "expert_dp") and expert_parallel == 1:
                continue  # no expert parallelism: `ep` has one rank and `expert_dp` is `dp_cp`
            if name in ("cp", "dp_cp") and context_parallel == 1:
                continue  # no context parallelism: `cp` has one rank and `dp_cp` is `dp`
            for ranks in groups(grid):
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    mine[name] = Communicator(name, group, len(ranks), ranks.index(rank), stats,
                                              shared_memory=shared_memory, timeout_s=timeout_s)
        return cls(rank=rank, world_size=world, device=device, comm=stats,
                   world=Communicator("world", None, world, rank, stats), **mine)


def default_device() -> torch.device:
    """This process's accelerator (cuda:LOCAL_RANK) when there is one, else the CPU. Under
    `SHARDLM_BACKEND=gloo_staged` (`shardlm.parallel.staged`) ranks share the GPUs: cuda:(LOCAL_RANK mod GPUs)."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        return torch.device("cuda", local % torch.cuda.device_count() if backend_name() == STAGED else local)
    return torch.device("cpu")


def init_distributed(tensor_parallel: int, timeout_s: float = 600.0,
                     device: torch.device | None = None, pipeline_parallel: int = 1,
                     expert_parallel: int = 1, context_parallel: int = 1) -> ParallelContext:
    """Initialize torch.distributed from the torchrun environment and return this rank's context.

    The backend follows the device: NCCL for CUDA, gloo for CPU; `SHARDLM_BACKEND=gloo_staged` runs gloo on CPU
    copies of CUDA tensors, so that several ranks can share one GPU (`shardlm.parallel.staged`). Without torchrun
    variables (a plain `python` process) this is a world of one. `timeout_s` bounds every collective, so a dead
    peer ends the run with an error instead of a hang.
    """
    device = device or default_device()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_layout(world, tensor_parallel, pipeline_parallel, context_parallel)
    if world == 1 and not dist.is_initialized():
        return ParallelContext.single(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = backend_for(device)
        rank = int(os.environ["RANK"])
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(backend=backend, store=_attempt_store(rank, world, timeout), rank=rank,
                                world_size=world, timeout=timeout)
    return ParallelContext.from_process_group(tensor_parallel, device, timeout_s, pipeline_parallel, expert_parallel,
                                              context_parallel)


def _attempt_store(rank: int, world: int, timeout: timedelta):
    """The torchrun rendezvous store, namespaced by restart attempt.

    After `torchrun --max-restarts` restarts a group, the store can still hold the addresses the
    previous workers published; new workers reading them connect to dead ports. A prefix per
    attempt (TORCHELASTIC_RESTART_COUNT) keeps every attempt's keys apart.
    """
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_hosts_store, timeout=timeout)
    return dist.PrefixStore(f"shardlm/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
