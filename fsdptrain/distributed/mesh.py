"""Process group, device and the (dp, sp) device mesh."""

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdptrain.errors import ConfigError


@dataclass
class Parallel:
    """Where this process sits: FSDP shards over all ranks; ranks of one SP group share their samples."""

    device: torch.device
    mesh: DeviceMesh  # 2-D, dims ("dp", "sp")
    fsdp_mesh: DeviceMesh  # 1-D over every rank: parameters shard over dp and sp alike
    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    sp_rank: int
    sp_size: int
    hybrid_meshes: dict[int, DeviceMesh] = field(default_factory=dict)  # by shard group size, built once each

    def sharding_mesh(self, fsdp_size: int) -> DeviceMesh:
        """The mesh a model's parameters shard over: every rank (fsdp_size -1, or the world), else 2-D (replicate,
        shard): groups of fsdp_size consecutive ranks (a node's) that each hold the whole model, replicated across
        the groups (HSDP). Every rank calls it alike: a new size is a new process group."""
        if fsdp_size in (-1, self.world_size):
            return self.fsdp_mesh
        if fsdp_size not in self.hybrid_meshes:
            self.hybrid_meshes[fsdp_size] = init_device_mesh(self.device.type, (self.world_size // fsdp_size, fsdp_size),
                                                             mesh_dim_names=("replicate", "shard"))
        return self.hybrid_meshes[fsdp_size]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

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


def init_parallel(device_preference: str, sp_size: int, timeout_s: float = 1800) -> Parallel:
    """Join (or, run without torchrun, create) the process group, whose collectives wait `timeout_s` for every
    rank, and build the (dp, sp) mesh."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    device = resolve_device(device_preference)
    world_size = int(os.environ["WORLD_SIZE"])
    check_sp_divides_world(sp_size, world_size)
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    mesh = init_device_mesh(device.type, (world_size // sp_size, sp_size), mesh_dim_names=("dp", "sp"))
    return Parallel(
        device=device,
        mesh=mesh,
        fsdp_mesh=init_device_mesh(device.type, (world_size,), mesh_dim_names=("fsdp",)),
        rank=dist.get_rank(),
        world_size=world_size,
        dp_rank=mesh.get_local_rank("dp"),
        dp_size=world_size // sp_size,
        sp_rank=mesh.get_local_rank("sp"),
        sp_size=sp_size,
    )
