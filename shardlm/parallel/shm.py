"""Collectives through shared memory for the ranks of one group that run on the same machine.

gloo moves every byte through loopback TCP: on a CPU an all-reduce of a (4, 512, 512) fp32
activation (4 MiB) takes about 6 ms between two processes and a one-element one about 0.35 ms,
which at TP=2 is a tenth of a training step. Processes on one machine can instead share a memory
segment: each writes its tensor into its own slot, waits until every rank has written, reduces
its 1/n share of the elements across the slots and, after a second wait, copies the reduced shares
of the others out: three passes over the tensor and two waits on spinning flags (microseconds).

Layout of the segment (a file in /dev/shm, unlinked as soon as every rank has mapped it, so nothing
is left behind even if a process dies): one int64 flag and the process id of each rank (the
header), then two banks (alternated per collective, so a rank can start writing the next one while
a slower rank still reads this one) of one `SLOT_BYTES` slot per rank. Tensors larger than a slot
go through in slot-sized pieces.

A rank's flag counts the waits it has arrived at; every rank of the group makes the same calls in
the same order (as with any collective), so "every flag >= mine" means every rank has arrived. A
wait raises instead of hanging when a late rank's process has exited or the group's timeout passes.

Only on x86-64, whose memory model orders a rank's data stores before its flag store as other
cores see them; elsewhere, and where the environment sets SHARDLM_SHM_COLLECTIVES=0, shardlm uses
gloo for everything.
"""

from __future__ import annotations

import os
import platform
import time
import uuid

import torch
import torch.distributed as dist

SLOT_BYTES = 4 << 20
"""Bytes per rank and bank: one (4, 512, 512) fp32 activation in one piece."""
SPIN_YIELDS = 2000
"""Waits first yield the core this many times (the peer is usually microseconds away), then sleep."""
DEFAULT_TIMEOUT_S = 600.0
"""How long a wait may last when the group has no timeout of its own (`train.timeout_s`'s default)."""


def shared_memory_wanted(device: torch.device) -> bool:
    """True when shardlm should try shared-memory collectives: CPU tensors on x86-64, not disabled."""
    return (device.type == "cpu" and platform.machine().lower() in ("x86_64", "amd64")
            and os.environ.get("SHARDLM_SHM_COLLECTIVES", "1") != "0" and os.path.isdir("/dev/shm"))


def header_bytes(size: int) -> int:
    """Bytes before the slots: one int64 flag and one int64 process id per rank, in whole 64-byte lines."""
    return -(-16 * size // 64) * 64


def machine_id() -> str:
    """What must be equal for two processes to share a segment: the boot (the machine), the /dev/shm
    mount (containers on one machine usually have their own) and the PID namespace (so a peer's process
    id means the same process to both)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/dev/shm').st_dev}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return f"{platform.node()}:{os.getpid()}"  # unknown: never equal, so gloo


def process_alive(pid: int) -> bool:
    """True while process `pid` exists and has not exited (a zombie, exited but not yet reaped, counts as
    exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class SharedMemoryGroup:
    """All-reduce, all-gather and reduce-scatter over one process group's shared segment.

    Build it with `SharedMemoryGroup.connect(group, size, rank, timeout_s)`, a collective over
    `group` that returns None (use gloo) when the ranks are not all on this machine or the segment
    cannot be made.
    """

    def __init__(self, segment: torch.Tensor, size: int, rank: int, timeout_s: float):
        self.size, self.rank, self.timeout_s = size, rank, timeout_s
        self._segment = segment  # keeps the mapping alive
        header = header_bytes(size)
        ids = segment[:header].view(torch.int64).numpy()  # numpy: cheap reads in the wait loop
        self._flags, self.pids = ids[:size], ids[size:2 * size]
        self.pids[rank] = os.getpid()
        self.banks = segment[header:].view(2, size, SLOT_BYTES)
        self.arrivals = 0
        self.collectives = 0

    @classmethod
    def connect(cls, group, size: int, rank: int, timeout_s: float | None) -> SharedMemoryGroup | None:
        # one exchange: each rank's machine, and the name rank 0 gives the segment
        offers = [None] * size
        dist.all_gather_object(offers, (machine_id(), f"/dev/shm/shardlm-{uuid.uuid4().hex}" if rank == 0 else None),
                               group=group)
        if len({machine for machine, _ in offers}) != 1:
            return None  # the group spans machines: gloo
        path, nbytes = offers[0][1], header_bytes(size) + 2 * size * SLOT_BYTES
        segment = None
        if rank == 0:
            try:  # reserve the pages now: a full /dev/shm fails here, not with SIGBUS mid-step
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                finally:
                    os.close(fd)
            except OSError:
                pass
        dist.barrier(group=group)
        try:
            segment = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        except (OSError, RuntimeError):
            segment = None
        shared = None if segment is None else cls(segment, size, rank, timeout_s or DEFAULT_TIMEOUT_S)  # its pid
        mapped = [None] * size
        # also: every rank is done mapping, and its process id is in the header
        dist.all_gather_object(mapped, segment is not None, group=group)
        if rank == 0:
            try:
                os.unlink(path)
            except OSError:
                pass
        if not all(mapped):
            return None
        shared.path = path  # unlinked above: the mapping lives on, the file does not
        return shared

    # --- waiting -----------------------------------------------------------------------------
    def _arrive_and_wait(self, what: str) -> None:
        """Barrier over the group on the flags: mark this rank arrived, wait for all the others. Raises when
        a late rank's process has exited (checked every 0.5 s) or the timeout passes."""
        self.arrivals += 1
        flags, target = self._flags, self.arrivals
        flags[self.rank] = target
        spins = 0
        deadline = next_check = None
        while flags.min() < target:
            spins += 1
            if spins < SPIN_YIELDS:
                os.sched_yield()
                continue
            now = time.monotonic()
            if deadline is None:
                deadline, next_check = now + self.timeout_s, now + 0.5
            elif now > next_check or now > deadline:
                next_check = now + 0.5
                late = [r for r in range(self.size) if flags[r] < target]
                exited = [r for r in late if not process_alive(int(self.pids[r]))]
                if exited:
                    raise RuntimeError(f"shared-memory {what} over a group of {self.size} failed: the process of "
                                       f"rank {exited[0]} (pid {int(self.pids[exited[0]])}) has exited")
                if now > deadline:
                    raise RuntimeError(f"shared-memory {what} over a group of {self.size} timed out after "
                                       f"{self.timeout_s:g} s: ranks {late} did not arrive (a peer failed or "
                                       "stopped calling collectives)")
            time.sleep(50e-6)

    def _slots(self, dtype: torch.dtype, count: int) -> list[torch.Tensor]:
        """This collective's bank, each rank's slot viewed as `count` elements of `dtype`."""
        bank = self.banks[self.collectives % 2]
        self.collectives += 1
        return [bank[r, :count * dtype.itemsize].view(dtype) for r in range(self.size)]

    def _share(self, count: int, rank: int) -> tuple[int, int]:
        """[start, end) of rank's share of `count` elements (the first `count % size` get one more)."""
        base, extra = divmod(count, self.size)
        start = rank * base + min(rank, extra)
        return start, start + base + (rank < extra)

    def _piece(self, dtype: torch.dtype) -> int:
        """Elements of `dtype` in one slot."""
        return SLOT_BYTES // dtype.itemsize

    # --- collectives -------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In place: every rank's `tensor` (any shape) becomes the sum (or max) over the group."""
        if not tensor.is_contiguous():
            return tensor.copy_(self.all_reduce(tensor.contiguous(), op))
        flat = tensor.view(-1)
        combine = torch.maximum if op == dist.ReduceOp.MAX else torch.add
        piece = self._piece(tensor.dtype)
        for offset in range(0, flat.numel(), piece):
            part = flat[offset:offset + piece]
            slots = self._slots(tensor.dtype, part.numel())
            slots[self.rank].copy_(part)
            self._arrive_and_wait("all_reduce")
            start, end = self._share(part.numel(), self.rank)
            mine = slots[self.rank][start:end]
            for r in range(self.size):  # each element is reduced by one rank only: all ranks get the same bits
                if r != self.rank:
                    combine(mine, slots[r][start:end], out=mine)
            self._arrive_and_wait("all_reduce")
            for r in range(self.size):
                start, end = self._share(part.numel(), r)
                part[start:end].copy_(slots[r][start:end])
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor`, in rank order; None when it does not fit one slot (use gloo)."""
        if tensor.numel() > self._piece(tensor.dtype):
            return None
        tensor = tensor.contiguous()
        slots = self._slots(tensor.dtype, tensor.numel())
        slots[self.rank].copy_(tensor.view(-1))
        self._arrive_and_wait("all_gather")
        return [slots[r].clone().view(tensor.shape) if r != self.rank else tensor.clone()
                for r in range(self.size)]

    def reduce_scatter(self, chunks: list[torch.Tensor]) -> torch.Tensor | None:
        """The sum over the group of everyone's `chunks[rank]` (equal shapes); None when the chunks do not
        fit one slot (use gloo). Whether a tensor fits depends only on its shape, the same on every rank."""
        count = chunks[0].numel()
        if count * self.size > self._piece(chunks[0].dtype):
            return None
        slots = self._slots(chunks[0].dtype, count * self.size)
        mine = slots[self.rank]
        for r, chunk in enumerate(chunks):
            mine[r * count:(r + 1) * count].copy_(chunk.reshape(-1))
        self._arrive_and_wait("reduce_scatter")
        region = slice(self.rank * count, (self.rank + 1) * count)
        out = slots[0][region].clone()
        for r in range(1, self.size):
            out.add_(slots[r][region])
        return out.view(chunks[0].shape)
