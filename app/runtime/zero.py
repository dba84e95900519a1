"""DeepSpeed ZeRO: its configuration, the training engine, a frozen reference partitioned like the policy, and
gathering partitioned parameters for no-grad forwards (rollouts, reference log-probs) and for saving.

The optimizer is torch AdamW handed to DeepSpeed (no CPUAdam build needed). Under ZeRO-3, loading a model inside
``zero.Init`` (transformers does so while an ``hf_deepspeed_config`` is alive) also makes DeepSpeed replace
``torch.nn.functional.linear`` with its own autograd function for the rest of the process (its documented
"memory-efficient linear"); ``app.planning.flops.train_flops`` counts what that changes (activation checkpointing then
recomputes each layer's last matmul too).
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import torch

from app.grouping import unwrap
from app.runtime import expert_parallel  # noqa: F401  (registers AutoEP's sparse blocks with the core)
from app.runtime.distributed import rank, world_size


def forwards_are_collective(engine) -> bool:
    """True when a forward through ``engine`` (hooks on) is a collective every rank must make: ZeRO-3 with several
    ranks (it all-gathers parameters), or expert parallelism (each sparse layer's all-to-all)."""
    from app.runtime.expert_parallel import size_of

    return (_partitioned(engine) and world_size() > 1) or size_of(engine) > 1


def parameters_stay_put(engine, mode: str = "full") -> bool:
    """Whether forwards inside ``gathered_for_inference(engine, mode)`` run on parameters that stay where they are
    (not ZeRO-3, or ZeRO-3 gathered once with ``full``): what a captured CUDA graph of a decode step needs. With
    ``layerwise`` or ``per_step`` DeepSpeed's gathering re-materialises parameters during every forward."""
    return not _partitioned(engine) or mode == "full"


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


@contextlib.contextmanager
def without_hf_zero3():
    """transformers' ZeRO-3 integration off for the block (a model built in it is not partitioned: a plain copy to
    export, a meta model to count), back on after."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


# DeepSpeed imports this module whenever it builds a ZeRO engine; imported first through the project, its
# torch.compile wrappers no longer import inductor's compiler at start-up (app.compat.import_without_compiling)
DEEPSPEED_MUON = "deepspeed.runtime.zero.muon.original_muon"


def _deepspeed():
    import deepspeed

    from app.compat import import_without_compiling

    import_without_compiling(DEEPSPEED_MUON)
    return deepspeed


def mark_leaf_modules(model) -> list[str]:
    """Under ZeRO-3, a mixture-of-experts model's sparse blocks become DeepSpeed leaf modules
    (``deepspeed.utils.set_z3_leaf_modules``): each block's parameters (router, experts, shared expert) are gathered
    in one go when the block starts, and no hook runs inside it, so the order of what a rank gathers never depends
    on which experts its tokens chose (DeepSpeed #4966/#5008: a rank waiting on a gather the others skip hangs).
    DeepSpeed's own defaults cover Mixtral and Qwen2/Qwen3-MoE, not Qwen3-VL-MoE's or Qwen3.5-MoE's blocks. Returns
    the classes marked (none for a dense model)."""
    from app.grouping.experts.blocks import sparse_layers

    classes = sorted({type(s.block) for s in sparse_layers(model)}, key=lambda c: c.__name__)
    if classes:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(unwrap(model), classes)
    return [c.__name__ for c in classes]


def inputs_require_grad(model) -> None:
    """Under ZeRO-3 a leaf module's backward hook reduces its parameters' gradients as soon as the gradients of the
    module's inputs are ready, and zero-fills any not computed yet (DeepSpeed's ``reduce_leaf_module_grads``, meant
    for experts no token chose). When a sparse block's inputs need no gradient (a frozen layer before it under LoRA)
    that hook runs first, before the adapters on its experts (peft's ``ParamWrapper``, whose factors feed the
    experts' weights, not the block's input) have their gradients: they arrive at a reduced, partitioned gradient
    and the backward fails ("The size of tensor a (0) must match ..."). transformers' ``enable_input_require_grads``
    (the input embeddings' output requires grad) makes every block's input carry a gradient, so the hook fires after
    the block's whole backward. Tested through the launcher (tests/test_experts_train.py)."""
    inner = unwrap(model)
    if hasattr(inner, "enable_input_require_grads"):
        inner.enable_input_require_grads()


def build_engine(model, ds_config: dict, optimizer, lr_scheduler):
    deepspeed = _deepspeed()
    if zero_stage(ds_config) == 3 and mark_leaf_modules(model):
        inputs_require_grad(model)

    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                           config=ds_config, model_parameters=None)
    return engine


def build_reference(model, ds_config: dict, device: torch.device):
    """Frozen reference: partitioned like the policy under ZeRO-3, otherwise a plain module on the device."""
    model.requires_grad_(False)
    model.eval()
    if zero_stage(ds_config) != 3:
        return model.to(device)
    deepspeed = _deepspeed()
    mark_leaf_modules(model)
    config = copy.deepcopy(ds_config)
    if "expert_parallel" in config:  # the policy's section, made again for this model (model.reference_path)
        from app.runtime.expert_parallel import reference_section

        config = reference_section(config, model)
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
    collectives, in which case ranks must step together: under expert parallelism always (each sparse layer's
    all-to-all), whatever the gather; ``full`` then gathers each rank's own experts only. Elsewhere the plain module,
    and nothing changes."""
    from app.runtime.expert_parallel import size_of

    if mode not in GATHER_MODES:
        raise ValueError(f"unknown ZeRO-3 gather mode {mode!r}; expected one of {GATHER_MODES}")
    module = unwrap(engine)
    experts = size_of(module) > 1
    if not _partitioned(engine):
        yield module, experts
        return
    if mode == "per_step":
        yield module, world_size() > 1
        return
    import deepspeed

    _check_gather_fits(module, mode)
    if mode == "full":
        with deepspeed.zero.GatheredParameters(list(module.parameters())), _hooks_off(engine, module):
            yield module, experts
        return
    layers = decoder_layers(module)
    in_layers = {id(p) for p in layers.parameters()}
    rest = [p for p in module.parameters() if id(p) not in in_layers]
    with deepspeed.zero.GatheredParameters(rest), _hooks_off(engine, module), _layer_by_layer(layers):
        yield module, world_size() > 1


def gathered_state_dict(engine) -> dict | None:
    """Full state dict on rank 0 (None elsewhere), gathering ZeRO-3 partitions, and under expert parallelism each
    sparse block's experts from its expert-parallel group, in the checkpoint's own names and layout
    (``expert_parallel.hf_state_dict``; every rank calls this)."""
    from app.runtime.expert_parallel import hf_state_dict

    module = unwrap(engine)
    if hasattr(engine, "zero_optimization_partition_weights") and engine.zero_optimization_partition_weights():
        import deepspeed

        # Gathered in the module's own naming, so save_pretrained maps keys exactly as for an unsharded model.
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()} if rank() == 0 else None
            return hf_state_dict(module, state)
    return hf_state_dict(module, {k: v.detach().cpu() for k, v in module.state_dict().items()} if rank() == 0 else None)


# ---- a frozen table ZeRO never touches: Qwen3.8-Flash-Next's PLE n-gram embedding ------------------------------------
class HostTable(torch.nn.Module):
    """A frozen embedding table read where it lies in a checkpoint's safetensors files, memory-mapped read-only (its
    pages are the OS's page cache: one copy per node, however many ranks map it), looked up on the host by the rows a
    batch needs, the rows sent to the ids' device in ``rows_dtype`` (the model's: ``.to(dtype)`` sets it, and the
    self-check's float32 reference, ``precision.float32_forward``, raises it for its forward). Neither a parameter nor a buffer: ZeRO-3 never
    partitions or gathers it, no optimizer holds state for it, ``.to(device)`` leaves it where it is, and checkpoints
    do not carry it (the export copies it from the source, ``expert_layouts.write_source_layout``). The shards are
    the table's dim-0 pieces in order (``split_ngram_parts`` of them, as the checkpoint stores it)."""

    def __init__(self, shards: list[torch.Tensor], dtype: torch.dtype):
        super().__init__()
        self.shards, self.rows_dtype = shards, dtype
        sizes = torch.tensor([s.shape[0] for s in shards], dtype=torch.long)
        self.starts = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
        self.dim = int(shards[0].shape[1])

    @property
    def weight(self) -> torch.Tensor:
        """What transformers' n-gram embedding reads of its table (the device it looks rows up on): an empty host
        tensor of the table's dtype."""
        return torch.empty(0, self.dim, dtype=self.rows_dtype)

    @property
    def num_embeddings(self) -> int:
        return int(self.starts[-1])

    def _apply(self, fn, recurse=True):  # .to(device) leaves the table in host memory; .to(dtype) is the rows' dtype
        self.rows_dtype = fn(torch.empty(0, dtype=self.rows_dtype)).dtype
        return self

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to("cpu", torch.long)
        if len(flat) and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"n-gram rows {int(flat.min())}..{int(flat.max())} outside the table's "
                             f"{self.num_embeddings}")
        shard = torch.bucketize(flat, self.starts[1:], right=True)
        out = torch.empty(len(flat), self.dim, dtype=self.rows_dtype)
        for s in shard.unique().tolist():
            picked = shard == s
            out[picked] = self.shards[s][flat[picked] - self.starts[s]].to(self.rows_dtype)
        return out.view(*ids.shape, self.dim).to(ids.device)


def host_resident_tables(model, path: str | Path) -> int:
    """Replace each PLE n-gram table of ``model`` (``ple_embedding.ngram_embedding``) by a ``HostTable`` mapped from
    the checkpoint at ``path`` (its ``ngram_embedding.shard_{i}.weight`` tensors, or one ``ngram_embedding.weight``).
    Returns how many were replaced; a table the checkpoint does not hold stops naming it."""
    import re

    from app.runtime.expert_layouts import mapped_tensors, table_keys

    count = 0
    for name, module in unwrap(model).named_modules():
        table = getattr(module, "ngram_embedding", None)
        if not isinstance(table, torch.nn.Embedding):
            continue
        layer = re.search(r"layers\.\d+\.", name)
        tail = name[layer.start():] if layer else name
        source = Path(path)
        keys = table_keys(source, tail)
        if not keys:
            raise FileNotFoundError(f"{source}: no tensor of {tail}.ngram_embedding (the PLE n-gram table) in its "
                                    "safetensors files")
        mapped = mapped_tensors(source, keys)
        shards = [mapped[k] for k in keys]
        rows = sum(s.shape[0] for s in shards)
        if rows != table.num_embeddings or shards[0].shape[1] != table.embedding_dim:
            raise ValueError(f"{source}: {tail}.ngram_embedding holds {rows} x {shards[0].shape[1]} rows on disk, the "
                             f"model {table.num_embeddings} x {table.embedding_dim}")
        module.ngram_embedding = HostTable(shards, table.weight.dtype)
        count += 1
    return count
