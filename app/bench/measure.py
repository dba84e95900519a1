"""Measuring a forward+backward on any device, for checking the planner (app/planning/costs.py): live tensor memory (peak
and current bytes) and FLOPs.

Live memory, on any device: peak and current bytes of every tensor storage created
inside it (a TorchDispatchMode that sees each operator's outputs and a finalizer on each new storage).

This is the CPU counterpart of ``torch.cuda.max_memory_allocated`` for what tensors hold: it counts every storage an
operator returns, views once, and frees when the storage dies. It does not see scratch memory a kernel allocates
and frees inside itself, nor the allocator's rounding and caching. Storages that existed before the region
(parameters, gradients allocated beforehand) are not counted.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary


class LiveMemory(TorchDispatchMode):
    """``with LiveMemory() as mem: ...``; then ``mem.peak`` and ``mem.live`` in bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            if storage in self._seen or id(storage) in inputs:  # counted already, or written in place
                continue
            nbytes = storage.nbytes()
            self._seen[storage] = nbytes
            weakref.finalize(storage, self._free, nbytes)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        return out


def allocator_peak(fn):
    """``fn()``'s result and the peak bytes the allocator held above what it held when ``fn`` started: on CUDA
    ``max_memory_allocated``; on CPU the running sum of the profiler's memory events (the CPU allocator's own
    record of each allocation and free, in time order)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.memory_allocated() > 0:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        result = fn()
        torch.cuda.synchronize()
        return result, torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e.start_ns(), i, e.nbytes()) for i, e in enumerate(prof.profiler.kineto_results.events())
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return result, peak


def cpu_attention_flops() -> dict:
    """``FlopCounterMode(custom_mapping=...)`` entries for torch's fused CPU attention kernel and its backward,
    which torch's counter does not know (it counts the CUDA kernels): the same formulas as its CUDA SDPA entries."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    def forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out, query, key, value)

    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}


def forward_backward(model, prompts: dict, completions: torch.Tensor, mask: torch.Tensor, group: int, *,
                     mode: str = "grouped", backend: str | None = None, flops: bool = True,
                     return_entropy: bool = True, **forward_kwargs) -> dict:
    """One policy forward+backward of the completion log-probs as training runs it (``completion_logprobs``, the
    chunked head, the entropy the trainer asks for on its first pass), measured: ``peak`` bytes the allocator held
    above what it held before (``allocator_peak``; gradient buffers are allocated first, as ZeRO's are), ``saved``
    bytes autograd kept for the backward (parameters aside), ``seconds``; and with ``flops``, a second pass counted by
    ``torch.utils.flop_counter`` (the fused CPU attention kernel added; a mixture of experts' routed experts through
    ``eager``, whose per-expert matmuls it counts, as it does not count ``grouped_mm``). The counter runs apart: it holds tensors of
    its own (measured: +22% peak with activation checkpointing)."""
    import time

    from torch.utils.flop_counter import FlopCounterMode

    from app.grouping import attention_restored, completion_logprobs

    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved.setdefault(storage.data_ptr(), storage.nbytes())
        return tensor

    def scores():
        return completion_logprobs(model, prompts, completions, mask, group, mode=mode, backend=backend,
                                   return_entropy=return_entropy, **forward_kwargs).logprobs

    def measured_pass():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = scores()
        out.sum().backward()

    start = time.perf_counter()
    with attention_restored(model):
        _, peak = allocator_peak(measured_pass)
    seconds = time.perf_counter() - start
    counted = 0
    if flops:  # a mixture of experts counts through eager experts: the counter has no formula for grouped_mm
        from app.grouping.experts.blocks import experts_implementation, set_experts_implementation

        running = experts_implementation(model)
        counter = FlopCounterMode(display=False, custom_mapping=cpu_attention_flops())
        try:
            set_experts_implementation(model, "eager")
            with attention_restored(model), counter:
                scores().sum().backward()
        finally:
            if running is not None:
                set_experts_implementation(model, running)
        counted = counter.get_total_flops()
    return {"peak": peak, "saved": sum(saved.values()), "seconds": seconds, "flops": counted}
