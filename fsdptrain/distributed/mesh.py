"""Process group, device and the (dp, sp) device mesh."""

import math
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdptrain.errors import ConfigError


@dataclass
class Parallel:
    """Where this process sits: FSDP shards over all training ranks; ranks of one SP group share their samples.
    A run with standalone rollout ranks (trainer.v1.trainer_mode=separate_async) trains on the first `world_size`
    ranks of torchrun's world and generates on the others, which hold no part of the meshes (their dp and sp
    ranks are -1)."""

    device: torch.device
    mesh: DeviceMesh | None  # 2-D, dims ("dp", "sp"), over the training ranks (None on a standalone rollout rank)
    fsdp_mesh: DeviceMesh | None  # 1-D over every training rank: parameters shard over dp and sp alike
    rank: int
    world_size: int  # the training ranks: 0 .. world_size - 1
    dp_rank: int
    dp_size: int
    sp_rank: int
    sp_size: int
    group: dist.ProcessGroup | None = None  # the training ranks' collectives; None: torchrun's whole world trains
    rollout_ranks: int = 0  # torchrun's last ranks, which only generate
    timeout: timedelta = timedelta(minutes=30)  # how long every group's collectives wait for a rank
    hybrid_meshes: dict[int, DeviceMesh] = field(default_factory=dict)  # by shard group size, built once each

    def sharding_mesh(self, fsdp_size: int) -> DeviceMesh:
        """The mesh a model's parameters shard over: every rank (fsdp_size -1, or the world), else 2-D (replicate,
        shard): groups of fsdp_size consecutive ranks (a node's) that each hold the whole model, replicated across
        the groups (HSDP). Every rank calls it alike: a new size is a new process group."""
        if fsdp_size in (-1, self.world_size):
            return self.fsdp_mesh
        if fsdp_size not in self.hybrid_meshes:
            self.hybrid_meshes[fsdp_size] = training_mesh(self.device, (self.world_size // fsdp_size, fsdp_size), ("replicate", "shard"),
                                                          self.timeout)
        return self.hybrid_meshes[fsdp_size]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def generates_only(self) -> bool:
        """A standalone rollout rank: it serves generations to the training ranks (rl/rollout/remote.py)."""
        return self.rank >= self.world_size

    @property
    def standalone_rollout_ranks(self) -> range:
        """torchrun's ranks that only generate (none in the sync mode)."""
        return range(self.world_size, self.world_size + self.rollout_ranks)

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """This rank and the ranks at its place in the other SP groups: each sample of the step once."""
        return self.mesh.get_group("dp")

    @property
    def ulysses_group(self) -> dist.ProcessGroup | None:
        """The sequence-parallel group, or None without sequence parallelism."""
        return self.mesh.get_group("sp") if self.sp_size > 1 else None


@dataclass(frozen=True)
class World:
    """The processes of the run as torchrun describes them to each, known before the process group starts (a
    plain `python -m` run is one process): what a trainer's plan checks its sizes against."""

    rank: int
    world_size: int
    host_processes: int  # training processes on this host, which share its memory when they run on CPU
    device: torch.device
    here: bool = True  # the run's machine is this one: its installed packages are the run's (fsdptrain.check for another: False)


def world_from_environment(device_preference: str) -> World:
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    return World(int(os.environ.get("RANK", 0)), world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
                 resolve_device(device_preference))


def check_fsdp_size(fsdp_size: int, world_size: int, key: str) -> None:
    """Hybrid sharding needs whole shard groups."""
    if fsdp_size != -1 and world_size % fsdp_size:
        raise ConfigError(f"{key} ({fsdp_size}) must divide the number of processes ({world_size}): the model is sharded over groups "
                          "of that many ranks and replicated across the groups")


def check_sp_divides_world(sp_size: int, world_size: int) -> None:
    """The (dp, sp) mesh needs whole sequence-parallel groups."""
    if world_size % sp_size:
        raise ConfigError(f"ulysses_sequence_parallel_size ({sp_size}) must divide the number of processes ({world_size})")


def resolve_device(preference: str) -> torch.device:
    if preference == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is available")
    if preference == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def training_mesh(device: torch.device, shape: tuple[int, ...], names: tuple[str, ...], timeout: timedelta) -> DeviceMesh | None:
    """A mesh of `shape` over the first ranks of torchrun's world (all but its standalone rollout ranks, for which
    it is None), each of its groups waiting `timeout` for a rank: a mesh's own groups would wait torch's default
    (30 minutes under gloo) whatever the run's process group was given, and a rank stuck in one would outlive
    trainer.nccl_timeout. Every rank of the world builds every group, as new_group asks."""
    ranks, rank, world_size = torch.arange(math.prod(shape)).view(shape), dist.get_rank(), dist.get_world_size()
    own = []
    for dim, size in enumerate(shape):
        for members in ranks.movedim(dim, -1).reshape(-1, size).tolist():
            group = dist.group.WORLD if size == world_size else dist.new_group(members, timeout=timeout)
            if rank in members:
                own.append(group)
    return DeviceMesh.from_group(own, device.type, mesh=ranks, mesh_dim_names=names) if rank < ranks.numel() else None


def init_parallel(device_preference: str, sp_size: int, timeout_s: float = 1800, rollout_ranks: int = 0) -> Parallel:
    """Join (or, run without torchrun, create) the process group, whose collectives wait `timeout_s` for every
    rank, and build the (dp, sp) mesh over the training ranks: all but torchrun's last `rollout_ranks`."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    device = resolve_device(device_preference)
    world_size = int(os.environ["WORLD_SIZE"]) - rollout_ranks
    check_sp_divides_world(sp_size, world_size)
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    timeout = timedelta(seconds=timeout_s)
    mesh = training_mesh(device, (world_size // sp_size, sp_size), ("dp", "sp"), timeout)
    fsdp_mesh = training_mesh(device, (world_size,), ("fsdp",), timeout)
    rank = dist.get_rank()
    trains = rank < world_size
    return Parallel(
        device=device,
        mesh=mesh,
        fsdp_mesh=fsdp_mesh,
        rank=rank,
        world_size=world_size,
        dp_rank=mesh.get_local_rank("dp") if trains else -1,
        dp_size=world_size // sp_size,
        sp_rank=mesh.get_local_rank("sp") if trains else -1,
        sp_size=sp_size,
        group=fsdp_mesh.get_group() if rollout_ranks and trains else None,
        rollout_ranks=rollout_ranks,
        timeout=timeout,
    )
