"""DeepSpeed set-up (ZeRO-2 / ZeRO-3 / offload), process-group start, rank helpers.

On CPU the accelerator is DeepSpeed's ``cpu`` with the gloo backend; parameters stay float32. On GPU, nccl and
the dtype from the config (bf16). The optimizer is torch AdamW handed to DeepSpeed (no CPUAdam build needed).
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

import torch

from app.grouping import unwrap

log = logging.getLogger("app.distributed")
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


def init_distributed(use_deepspeed: bool = True) -> tuple[int, int]:
    """Start (or join) the process group; a plain `python -m ...` run becomes a world of one. Workers started by
    torchrun die with it (``die_with_launcher``). ``use_deepspeed=False`` (evaluation) starts a plain torch
    process group: no DeepSpeed communication op is loaded."""
    import torch.distributed as dist

    die_with_launcher()
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(_free_port()))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if use_deepspeed:
            import deepspeed

            # DeepSpeed loads its JIT-built CPU op inside init_distributed, through torch's bare lock file. Load it
            # first under our guard (never wait silently on a dead lock); DeepSpeed then reuses the loaded op. The
            # guard is not held across the rendezvous, which waits for the other ranks.
            prepare_comm_op()
            deepspeed.init_distributed(dist_backend=backend)
        else:
            dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


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


# ---- sequence parallelism: S consecutive ranks hold one packed row; data parallelism runs over world / S --------
_SEQUENCE_PARALLEL = None  # this rank's SequenceParallel (set by init_sequence_parallel), None when S = 1


def init_sequence_parallel(size: int):
    """Split the world into groups of ``size`` consecutive ranks that share every packed row (the grouped forward
    runs sequence-parallel over them; rollouts, rewards and data are the same on each). Returns this rank's
    ``SequenceParallel`` (its gradients scaled for DeepSpeed's average over the world), or None for size 1."""
    import torch.distributed as dist

    from app.grouping.sequence_parallel import SequenceParallel

    global _SEQUENCE_PARALLEL
    world, me = world_size(), rank()
    if size <= 1:
        _SEQUENCE_PARALLEL = None
        return None
    if world % size:
        raise ValueError(f"train.sequence_parallel_size={size} must divide the number of ranks ({world})")
    mine = None
    for first in range(0, world, size):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(first, first + size)))
        if first <= me < first + size:
            mine = group
    _SEQUENCE_PARALLEL = SequenceParallel(rank=me % size, size=size, group=mine).for_averaging()
    return _SEQUENCE_PARALLEL


def sequence_parallel():
    """This rank's ``SequenceParallel``, or None without sequence parallelism."""
    return _SEQUENCE_PARALLEL


def data_parallel_rank() -> int:
    """Which data-parallel replica this rank belongs to (its SP group's index): what picks prompts and seeds."""
    sp = _SEQUENCE_PARALLEL
    return rank() // sp.size if sp is not None else rank()


def data_parallel_size() -> int:
    sp = _SEQUENCE_PARALLEL
    return world_size() // sp.size if sp is not None else world_size()


def _counts_once() -> bool:
    """Whether this rank's values enter data-parallel sums: one rank per SP group (the group's ranks hold copies)."""
    return _SEQUENCE_PARALLEL is None or _SEQUENCE_PARALLEL.rank == 0


def data_parallel_sum(values: list[float]) -> list[float]:
    """``all_reduce_sum`` over the data-parallel replicas: each SP group's values counted once."""
    return all_reduce_sum(values if _counts_once() else [0.0] * len(values))


def data_parallel_gather(values: list[float]) -> list[list[float]]:
    """``all_gather_floats`` keeping one row per data-parallel replica (each SP group's first rank)."""
    rows = all_gather_floats(values)
    sp = _SEQUENCE_PARALLEL
    return rows if sp is None else rows[::sp.size]


def same_in_sequence_parallel_group(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` as the SP group's first rank has them, on every rank of the group (rollouts: each rank samples
    the same prompts with the same seeds, and this makes sure they train on the very same tokens). Tensor
    collectives only (first the shapes, then each tensor on the backend's device: the GPU under nccl), each result
    on its input's device and in its dtype; the other ranks' shapes may differ. Identity without sequence
    parallelism."""
    import torch.distributed as dist

    sp = _SEQUENCE_PARALLEL
    if sp is None:
        return tensors
    src = dist.get_global_rank(sp.group, 0)
    device = local_device() if dist.get_backend() == "nccl" else torch.device("cpu")
    most = 4
    if any(t.dim() > most for t in tensors):
        raise ValueError(f"same_in_sequence_parallel_group takes tensors of at most {most} dimensions")
    shapes = torch.tensor([[t.dim(), *t.shape, *[0] * (most - t.dim())] for t in tensors], dtype=torch.long,
                          device=device)
    dist.broadcast(shapes, src=src, group=sp.group)
    out = []
    for t, row in zip(tensors, shapes.tolist()):
        shape = row[1 : 1 + row[0]]
        buffer = t.to(device).contiguous() if sp.rank == 0 else torch.empty(shape, dtype=t.dtype, device=device)
        dist.broadcast(buffer, src=src, group=sp.group)
        out.append(buffer.to(t.device))
    return out


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


def _comm_tensor(values: list[float]) -> torch.Tensor:
    """float64 on the device the backend reduces on (nccl: the GPU; gloo: the CPU)."""
    import torch.distributed as dist

    device = local_device() if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"
    return torch.tensor(values, dtype=torch.float64, device=device)


def all_reduce_sum(values: list[float]) -> list[float]:
    import torch.distributed as dist

    tensor = _comm_tensor(values)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor.tolist()


def all_reduce_max(values: list[float]) -> list[float]:
    import torch.distributed as dist

    tensor = _comm_tensor(values)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def all_gather_floats(values: list[float]) -> list[list[float]]:
    """Every rank's ``values`` (the same length on each), in rank order: one collective."""
    import torch.distributed as dist

    tensor = _comm_tensor(values)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [tensor.tolist()]
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor)
    return [p.tolist() for p in parts]


def forwards_are_collective(engine) -> bool:
    """True when a forward through ``engine`` (hooks on) all-gathers parameters: ZeRO-3 with several ranks."""
    return _partitioned(engine) and world_size() > 1


def load_deepspeed_config(path: str | Path, *, gradient_accumulation_steps: int, max_grad_norm: float,
                          dtype: str) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config not found: {path}")
    config = json.loads(path.read_text())
    config["train_micro_batch_size_per_gpu"] = 1  # one micro-batch of groups per forward
    config["gradient_accumulation_steps"] = gradient_accumulation_steps
    config["train_batch_size"] = gradient_accumulation_steps * world_size()
    config["gradient_clipping"] = max_grad_norm
    config["bf16"] = {"enabled": dtype == "bfloat16"}
    config.setdefault("fp16", {"enabled": False})
    config["zero_allow_untested_optimizer"] = True
    config.setdefault("steps_per_print", 10**9)
    config.setdefault("wall_clock_breakdown", False)
    zero = config.setdefault("zero_optimization", {"stage": 0})
    if zero.get("stage") == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return config


def zero_stage(ds_config: dict) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def hf_deepspeed_config(ds_config: dict):
    """Under ZeRO-3, from_pretrained must partition while loading: keep the returned object alive."""
    if zero_stage(ds_config) != 3:
        return None
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(ds_config)


def build_engine(model, ds_config: dict, optimizer, lr_scheduler):
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                           config=ds_config, model_parameters=None)
    return engine


def build_reference(model, ds_config: dict, device: torch.device):
    """Frozen reference: partitioned like the policy under ZeRO-3, otherwise a plain module on the device."""
    model.requires_grad_(False)
    model.eval()
    if zero_stage(ds_config) != 3:
        return model.to(device)
    import deepspeed

    config = copy.deepcopy(ds_config)
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    config["zero_optimization"] = {k: v for k, v in config["zero_optimization"].items()
                                   if not k.startswith("offload_optimizer")}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


GATHER_MODES = ("full", "layerwise", "per_step")


def _partitioned(engine) -> bool:
    check = getattr(engine, "zero_optimization_partition_weights", None)
    return bool(check and check())


def decoder_layers(module) -> torch.nn.ModuleList:
    """The language model's decoder layers (the longest ModuleList named ``layers``; vision blocks are ``blocks``)."""
    lists = [m for name, m in module.named_modules() if name.split(".")[-1] == "layers"
             and isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(module).__name__} has no decoder `layers` list; use rollout.zero3_gather=full")
    return max(lists, key=len)


def _gather_bytes(params) -> int:
    return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in params)


def _check_gather_fits(module, mode: str) -> None:
    if not torch.cuda.is_available():
        return
    need = _gather_bytes(module.parameters())
    if mode == "layerwise":
        layers = decoder_layers(module)
        need -= _gather_bytes(layers.parameters()) - max(_gather_bytes(layer.parameters()) for layer in layers)
    free, _ = torch.cuda.mem_get_info()
    if need > 0.9 * free:
        lighter = ("rollout.zero3_gather=layerwise (everything but the decoder layers gathered once, one layer at a "
                   "time at each decode step) or per_step" if mode == "full" else "rollout.zero3_gather=per_step")
        raise MemoryError(
            f"rollout.zero3_gather={mode} needs {need / 2**30:.1f} GiB of gathered weights but only "
            f"{free / 2**30:.1f} GiB of GPU memory is free; set {lighter} (slower), or free memory (smaller "
            "micro-batches, optimizer offload)")


@contextlib.contextmanager
def _hooks_off(engine, module):
    """DeepSpeed's ZeRO-3 module hooks off for the block, the start-of-forward one too (DeepSpeed's own
    unwrap_model_for_generation leaves it, and it runs a collective trace check at every forward)."""
    optimizer = engine.optimizer
    offload = getattr(optimizer, "parameter_offload", optimizer)
    offload._remove_module_hooks()
    offload.forward_hooks, offload.backward_hooks = [], []
    for param in module.parameters():
        param.ds_active_sub_modules.clear()
    try:
        yield
    finally:
        offload.setup_zero_stage3_hooks()  # re-adds them and invalidates the recorded trace


@contextlib.contextmanager
def _layer_by_layer(layers):
    """Each decoder layer gathers its parameters in one coalesced all-gather as it starts, and releases them (back
    to this rank's partition) as it ends."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    whole: dict[int, list] = {}

    def gather(layer, *_):
        params = [p for p in layer.parameters() if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        if params:
            params[0].all_gather_coalesced(params).wait()
        whole[id(layer)] = params

    def release(layer, *_):
        params = whole.pop(id(layer))
        if params:
            params[0].partition(param_list=params, has_been_updated=False)

    handles = [h for layer in layers for h in (layer.register_forward_pre_hook(gather),
                                                 layer.register_forward_hook(release))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for params in whole.values():  # an exception inside a layer
            if params:
                params[0].partition(param_list=params, has_been_updated=False)


@contextlib.contextmanager
def gathered_for_inference(engine, mode: str = "full"):
    """Yield ``(module, collective)`` to run no-grad forwards on.

    Under ZeRO-3 (``rollout.zero3_gather``):
    - ``full``: every parameter is gathered ONCE and DeepSpeed's hooks are off for the block (as TRL's
      ``unwrap_model_for_generation`` does): decoding costs no all-gathers and no collective at all;
    - ``layerwise``: everything but the decoder layers is gathered once; each decoder layer is gathered in one
      collective when it runs and released after, so at most one layer is whole at a time (for models whose full
      gather does not fit); forwards are collective;
    - ``per_step``: DeepSpeed's own hooks, every module re-gathered at every forward (least memory, slowest).
    Partitioning and the hooks come back on exit. ``collective`` tells whether forwards inside still issue
    collectives, in which case ranks must step together. Elsewhere the plain module, and nothing changes."""
    if mode not in GATHER_MODES:
        raise ValueError(f"unknown ZeRO-3 gather mode {mode!r}; expected one of {GATHER_MODES}")
    module = unwrap(engine)
    if not _partitioned(engine):
        yield module, False
        return
    if mode == "per_step":
        yield module, world_size() > 1
        return
    import deepspeed

    _check_gather_fits(module, mode)
    if mode == "full":
        with deepspeed.zero.GatheredParameters(list(module.parameters())), _hooks_off(engine, module):
            yield module, False
        return
    layers = decoder_layers(module)
    in_layers = {id(p) for p in layers.parameters()}
    rest = [p for p in module.parameters() if id(p) not in in_layers]
    with deepspeed.zero.GatheredParameters(rest), _hooks_off(engine, module), _layer_by_layer(layers):
        yield module, world_size() > 1


def gathered_state_dict(engine) -> dict | None:
    """Full state dict on rank 0 (None elsewhere), gathering ZeRO-3 partitions."""
    module = unwrap(engine)
    if hasattr(engine, "zero_optimization_partition_weights") and engine.zero_optimization_partition_weights():
        import deepspeed

        # Gathered in the module's own naming, so save_pretrained maps keys exactly as for an unsharded model.
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()} if rank() == 0 else None
    return {k: v.detach().cpu() for k, v in module.state_dict().items()} if rank() == 0 else None


if __name__ == "__main__":
    if sys.argv[1:] == ["--build-ops"]:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        built = prepare_comm_op()
        print(f"DeepSpeed {COMM_OP}: {'ready' if built else 'not used on this machine'}")
    else:
        raise SystemExit("usage: python -m app.distributed --build-ops")
