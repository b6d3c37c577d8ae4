"""Run under torchrun by test_multinode.py: a rank whose heartbeat beats without pause (its thread almost always
inside the store's client) leaves the process group by end_run and exits cleanly."""

import sys

import torch.distributed as dist

from fsdptrain.distributed import roll_call
from fsdptrain.trainer.setup import end_run


def main() -> None:
    roll_call.HEARTBEAT_S = 0.0
    dist.init_process_group("gloo")
    roll_call.start_heartbeat(dist.get_rank(), dist.get_world_size())
    dist.barrier()
    dist.barrier()
    end_run()
    print("left", dist.is_initialized(), file=sys.stderr)


if __name__ == "__main__":
    main()
