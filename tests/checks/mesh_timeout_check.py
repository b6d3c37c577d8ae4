"""Run under torchrun (4 ranks) by test_multinode.py: a group of the meshes a run builds (Ulysses' sp group, a
hybrid sharding's replicate group) gives up on a rank that never joins its collective after the run's timeout
(trainer.nccl_timeout), not after torch's default for new groups (30 minutes under gloo)."""

import sys
import time

import torch
import torch.distributed as dist

from fsdptrain.distributed.mesh import init_parallel

TIMEOUT_S = 5.0
ABSENT_S = 14.0  # how long the other ranks stay away: a group without the run's timeout waits until they leave


def main() -> None:
    parallel = init_parallel("cpu", sp_size=2, timeout_s=TIMEOUT_S)
    hybrid = parallel.sharding_mesh(2)
    groups = {"sp": parallel.ulysses_group, "replicate": hybrid.get_group("replicate")}
    if parallel.rank != 0:
        time.sleep(ABSENT_S)
        print("ok")
        return
    for name, group in groups.items():
        assert dist.get_world_size(group) == 2, (name, dist.get_world_size(group))
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4), group=group)
        except RuntimeError as e:
            waited = time.monotonic() - start
            assert waited < TIMEOUT_S + 3, f"the {name} group waited {waited:.1f} s, not the run's {TIMEOUT_S} s: {e}"
            assert "timed out" in str(e).lower() or "timeout" in str(e).lower(), e
            continue
        sys.exit(f"the {name} group's collective completed without its other rank")
    print("ok")


if __name__ == "__main__":
    main()
