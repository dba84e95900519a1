"""Launch: the process group's start and end, this rank's number and device, and DeepSpeed's CPU communication op.

On CPU the backend is gloo (DeepSpeed's ``cpu`` accelerator); on GPU, nccl. Where this rank sits among data- and
sequence-parallel groups, and the collectives a step needs, are ``app.runtime.parallel``; DeepSpeed's engine, the ZeRO
configuration and gathering partitioned parameters are ``app.runtime.zero``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger("app.runtime.distributed")
COMM_OP = "deepspeed_shm_comm"  # DeepSpeed's CPU shared-memory communication op, JIT-built on first use
COMM_OP_WAIT_S = 900.0  # the longest wait for another process of this environment building it (a build is ~50 s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_launcher() -> bool:
    """Under torchrun, ask Linux to SIGKILL this worker when its launcher dies (``PR_SET_PDEATHSIG``).

    torchrun starts its workers in their own sessions, so killing the launcher's process group (a scheduler's
    cancel, ``kill -9`` of scripts/train.sh) would otherwise leave them training on into the same output
    directory. Returns True when armed. If the launcher is already gone, exits at once.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    import ctypes
    import signal

    launcher = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
        return False
    if os.getppid() != launcher:  # the launcher died before the signal was armed
        os._exit(1)
    return True


@contextlib.contextmanager
def comm_op_guard(wait_s: float = COMM_OP_WAIT_S):
    """Hold this environment's lock on DeepSpeed's JIT-built CPU op while it is built or loaded, and clear a
    stale torch build lock first.

    torch guards a JIT build with a bare lock file (``<build dir>/lock``, no owner recorded) and every later
    process sleeps on it forever when its holder was killed. Every process of ours takes an ``flock`` on
    ``<build dir>.owner`` before touching that directory; the kernel releases an flock when its holder dies, so a
    ``lock`` file found while holding the flock was left by a dead process: it is removed with a warning. While
    another live process holds the flock we wait, saying so every 30 s with its pid, and stop after ``wait_s``
    naming the file.
    """
    from torch.utils.cpp_extension import _get_build_directory

    build = Path(_get_build_directory(COMM_OP, verbose=False))
    owner_path = build.parent / f"{build.name}.owner"
    with open(owner_path, "a+") as owner:
        start, said = time.monotonic(), None
        while True:
            try:
                fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                owner.seek(0)
                holder = owner.read().strip() or "unknown"
                if now - start > wait_s:
                    raise RuntimeError(
                        f"waited {wait_s:.0f} s for process {holder} building or loading DeepSpeed's {COMM_OP} in "
                        f"{build} (lock {owner_path}); if that process is stuck, stop it and run again") from None
                if said is None or now - said >= 30:
                    log.warning("waiting for process %s, which is building or loading DeepSpeed's %s in %s "
                                "(waited %.0f s so far)", holder, COMM_OP, build, now - start)
                    said = now
                time.sleep(0.5)
        owner.seek(0)
        owner.truncate()
        owner.write(str(os.getpid()))
        owner.flush()
        stale = build / "lock"
        if stale.exists():
            log.warning("removing a stale build lock %s: the process that made it was killed while building or "
                        "loading DeepSpeed's %s (no live process holds %s)", stale, COMM_OP, owner_path)
            stale.unlink(missing_ok=True)
        try:
            yield build
        finally:
            fcntl.flock(owner, fcntl.LOCK_UN)


def prepare_comm_op() -> bool:
    """Build (first time) or load DeepSpeed's CPU communication op under ``comm_op_guard``; False where none is
    used (CUDA, or an accelerator without it). ``scripts/setup_env.sh`` calls it at install time."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return False
    with comm_op_guard():
        builder.load(verbose=False)
    return True


def init_distributed(use_deepspeed: bool = True, timeout_s: float | None = None) -> tuple[int, int]:
    """Start (or join) the process group; a plain `python -m ...` run becomes a world of one. Workers started by
    torchrun die with it (``die_with_launcher``). ``use_deepspeed=False`` (evaluation) starts a plain torch
    process group: no DeepSpeed communication op is loaded. ``timeout_s`` (``train.collective_timeout_s``): how
    long a collective waits for the other ranks before it raises (``collective_failures`` names it)."""
    import datetime

    import torch.distributed as dist

    die_with_launcher()
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(_free_port()))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        timeout = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
        if use_deepspeed:
            import deepspeed

            # DeepSpeed loads its JIT-built CPU op inside init_distributed, through torch's bare lock file. Load it
            # first under our guard (never wait silently on a dead lock); DeepSpeed then reuses the loaded op. The
            # guard is not held across the rendezvous, which waits for the other ranks.
            prepare_comm_op()
            deepspeed.init_distributed(dist_backend=backend, **timeout)
        else:
            dist.init_process_group(backend, **timeout)
    return dist.get_rank(), dist.get_world_size()


COLLECTIVE_ERRORS = ("Timed out", "timed out", "Timeout", "timeout", "Connection closed by peer", "Connection reset")


def collective_name(error: BaseException) -> str | None:
    """The torch.distributed collective an error came from (the innermost frame in ``distributed_c10d``: all_reduce,
    all_gather_into_tensor, broadcast, ...), or None when it did not come from one or was no wait."""
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    ops = [code.co_name for code in frames if code.co_filename.endswith("distributed_c10d.py")
           and not code.co_name.startswith("_")]
    if not ops or not any(word in str(error) for word in COLLECTIVE_ERRORS):
        return None
    return ops[-1]


@contextlib.contextmanager
def collective_failures(timeout_s: float | None, key: str = "train.collective_timeout_s"):
    """A collective that waited past its timeout (or lost a peer) ends the run in one message naming the
    operation, this rank and the setting, instead of a backend traceback, or a hang where no timeout was set."""
    try:
        yield
    except (RuntimeError, OSError) as error:  # torch.distributed.DistError and the gloo/NCCL errors are these
        op = collective_name(error)
        if op is None:
            raise
        raise SystemExit(
            f"collective error: rank {rank()} of {world_size()} waited in torch.distributed.{op} longer than {key}="
            f"{timeout_s:g} s (or a peer left): another rank never joined it. Under ZeRO-3 that is a rank that "
            f"gathered other parameters than the rest (a mixture-of-experts block that is no leaf module), a "
            f"rank that died, or one still busy past the timeout; the other ranks' logs (logs/rank*.log) say "
            f"which. ({str(error).splitlines()[0][:200]})") from None


def local_device() -> torch.device:
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def shutdown() -> None:
    """End a distributed program cleanly: wait for every rank, then tear the process group down. Leaving it to the
    interpreter's exit can abort the process ("terminate called without an active exception", SIGABRT) when a
    communication thread is still alive while static objects are destroyed, seen under load."""
    import torch.distributed as dist

    barrier()
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_worker(code: int = 0) -> None:
    """End a worker program (benchmark point, test worker) after ``shutdown``: flush stdio and leave at once,
    without the interpreter's finalization. A gloo run that called ``destroy_process_group`` can still abort there
    ("terminate called without an active exception", SIGABRT: seen once in CI on a 2-rank sequence-parallel
    benchmark point, not reproduced in 8 local runs); a worker has nothing left to finalize."""
    shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


if __name__ == "__main__":
    if sys.argv[1:] == ["--build-ops"]:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        built = prepare_comm_op()
        print(f"DeepSpeed {COMM_OP}: {'ready' if built else 'not used on this machine'}")
    else:
        raise SystemExit("usage: python -m app.runtime.distributed --build-ops")
