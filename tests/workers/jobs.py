"""Run under torchrun: several workers' jobs in ONE launch, one after another on the same process group, so a test
module pays the start of S processes (interpreter, torch, transformers, gloo) once, not once per test.

Argument: a JSON file {"jobs": [{"module": "sequence_parallel" | "sp_rollout" | "spread_rollout", "spec": {...}},
...]}; each job is its module's ``run(spec)`` (the module's own docstring says what the spec holds and what it
writes). A job that raises writes its traceback to ``spec["out"] + ".error.RANK"`` and ends the launch: the tests
whose jobs ran before it still read their results; the others fail naming the error.
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback

import torch.distributed as dist

from app.runtime.distributed import exit_worker


def main(spec_path: str) -> None:
    jobs = json.loads(open(spec_path).read())["jobs"]
    dist.init_process_group("gloo")
    for job in jobs:
        try:
            importlib.import_module(f"tests.workers.{job['module']}").run(job["spec"])
        except BaseException:
            with open(f"{job['spec']['out']}.error.{dist.get_rank()}", "w") as f:
                f.write(traceback.format_exc())
            raise
        dist.barrier()  # the next job starts on every rank together
    exit_worker()


if __name__ == "__main__":
    main(sys.argv[1])
