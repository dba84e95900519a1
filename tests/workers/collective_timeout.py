"""Two ranks under torchrun: rank 0 enters an all_reduce that rank 1 never joins (it sleeps, then leaves). Through
the product's ``init_distributed(timeout_s=...)`` and ``collective_failures``, rank 0 must stop within the timeout
with one message naming the operation and its rank.

    python -m torch.distributed.run --nproc_per_node 2 tests/workers/collective_timeout.py TIMEOUT_S
"""

import sys
import time

import torch
import torch.distributed as dist

from app.runtime import distributed

timeout = float(sys.argv[1])
with distributed.collective_failures(timeout):
    rank, world = distributed.init_distributed(use_deepspeed=False, timeout_s=timeout)
    if rank == 0:
        dist.all_reduce(torch.ones(4))
        print("rank 0: the all_reduce returned", flush=True)
    else:
        time.sleep(3 * timeout)
