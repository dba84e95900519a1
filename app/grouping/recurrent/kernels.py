"""The one adapter to the Gated DeltaNet kernels: the causal conv and the chunked delta rule over one level of a
packed row's segments (``segments.LevelIndex``), each segment from its own initial state.

- CUDA with flash-linear-attention installed (0.6.x, ``fla``): ``fla.modules.causal_conv1d.causal_conv1d`` and
  ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, one varlen call each per level (``cu_seqlens``) with a
  per-sequence ``initial_state`` (conv: [N, C, W], the last W - 1 inputs in the last columns; delta rule:
  [N, HV, K, V]); their backwards return the initial states' gradients (``dh0``). fla may dispatch the delta rule
  to FlashQLA on sm90 and later; its ``dh0`` is not checked here, so the adapter turns it off
  (``FLA_FLASH_QLA=0``, unless the user set the variable) and says so once.
- Elsewhere: transformers' torch fallback of the chunked delta rule (``torch_chunk_gated_delta_rule``, unwrapped
  from its hub-kernel decorator) over the level's segments as padded rows, and the torch depthwise conv with each
  segment's parent's last W - 1 inputs in front. Pads carry k = v = q = 0, beta = 0 and g = 0, so a state passes
  through them unchanged and each row's final state is its segment's.

``level_kernels(device)`` picks one, feature-detected once; tests pass a stand-in of fla's signatures
(``FlaKernels(conv=..., rule=...)``) to drive the varlen wiring on CPU.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import os

import torch
import torch.nn.functional as F

log = logging.getLogger("app.grouping.recurrent")


def rows_of(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for an index of any shape, by ``index_select``: its backward (``index_add_``) sums a row's
    gradients in a fixed order, where advanced indexing's (a parallel ``index_put_``) sums repeated rows (a pad
    row, a parent's conv inputs read by each child) in an order that varies from run to run on several threads."""
    return table.index_select(0, index.to(table.device).reshape(-1)).view(*index.shape, *table.shape[1:])


@functools.cache
def torch_chunk_rule():
    """transformers' torch chunked delta rule, unwrapped from the decorator that would hand a CUDA-only fla kernel
    to a CPU tensor when fla is installed."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)


@functools.cache
def torch_recurrent_rule():
    """transformers' torch one-token delta rule (the decode step), unwrapped likewise."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return inspect.unwrap(modeling_qwen3_5.torch_recurrent_gated_delta_rule)


class TorchKernels:
    """The torch fallback over padded rows [N, Lmax] (any device)."""

    name = "torch"

    def gather(self, row: torch.Tensor, index) -> torch.Tensor:
        """[T + 1, ...] (last row zero) -> [N, Lmax, ...]."""
        return rows_of(row, index.padded)

    def scatter(self, values: torch.Tensor, index) -> tuple[torch.Tensor, torch.Tensor]:
        """(row positions, values) of the level's real tokens."""
        valid = index.valid.to(values.device)
        return index.padded.to(values.device)[valid], values[valid]

    def conv(self, row: torch.Tensor, index, weight: torch.Tensor) -> torch.Tensor:
        """SiLU(depthwise causal conv) of each segment with its path's last W - 1 inputs in front: row [T + 1, C]
        (last row zero), weight [C, W] -> [N, Lmax, C], zero at pads."""
        taps = torch.cat([index.before, index.padded], dim=1).to(row.device)  # [N, W - 1 + Lmax]
        x = rows_of(row, taps).transpose(1, 2)  # [N, C, W - 1 + Lmax]
        out = F.conv1d(x.to(weight.dtype), weight[:, None, :], groups=weight.shape[0]).transpose(1, 2)
        return F.silu(out).to(row.dtype) * index.valid.to(row.device)[..., None].to(row.dtype)

    def rule(self, q, k, v, *, g, beta, initial_state, index):
        """q, k [N, L, HV, K]; v [N, L, HV, V]; g, beta [N, L, HV]; initial [N, HV, K, V] or None -> (out, final)."""
        return torch_chunk_rule()(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)


class FlaKernels:
    """flash-linear-attention's varlen kernels (or stand-ins of their signatures): one run [1, sum L, ...] per level
    with ``cu_seqlens``."""

    name = "fla"

    def __init__(self, conv=None, rule=None):
        if conv is None or rule is None:
            from fla.modules.causal_conv1d import causal_conv1d
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            conv, rule = conv or causal_conv1d, rule or chunk_gated_delta_rule
        self._conv, self._rule = conv, rule

    def gather(self, row: torch.Tensor, index) -> torch.Tensor:
        return rows_of(row, index.flat)[None]

    def scatter(self, values: torch.Tensor, index) -> tuple[torch.Tensor, torch.Tensor]:
        return index.flat.to(values.device), values[0]

    def conv(self, row: torch.Tensor, index, weight: torch.Tensor) -> torch.Tensor:
        before = rows_of(row, index.before).transpose(1, 2)  # [N, C, W - 1]
        initial = torch.cat([before.new_zeros(before.shape[0], before.shape[1], 1), before], dim=2)  # [N, C, W]
        cu = index.cu_seqlens.to(row.device)
        out, _ = self._conv(rows_of(row, index.flat)[None], weight=weight, activation="silu",
                            initial_state=initial.to(weight.dtype).contiguous(), cu_seqlens=cu)
        return out.to(row.dtype)

    def rule(self, q, k, v, *, g, beta, initial_state, index):
        return self._rule(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True,
                          use_qk_l2norm_in_kernel=True, cu_seqlens=index.cu_seqlens.to(q.device))


def fla_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("fla") is not None


@functools.cache
def _fla_kernels() -> FlaKernels:
    if "FLA_FLASH_QLA" not in os.environ:
        os.environ["FLA_FLASH_QLA"] = "0"
        log.info("flash-linear-attention: FlashQLA turned off (FLA_FLASH_QLA=0): the grouped forward hands each "
                 "segment its parent's state, and FlashQLA's initial-state gradient has not been checked here")
    return FlaKernels()


def recurrent_step_rule(device):
    """The one-token delta rule of a decode step (same call as the chunked one): fla's fused recurrent kernel on
    CUDA when installed, else transformers' torch recurrence."""
    if torch.device(device).type == "cuda" and fla_available():
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        return fused_recurrent_gated_delta_rule
    return torch_recurrent_rule()


def level_kernels(device) -> TorchKernels | FlaKernels:
    """fla's kernels for CUDA tensors when the package is installed, else the torch fallback."""
    if torch.device(device).type == "cuda" and fla_available():
        return _fla_kernels()
    return TorchKernels()
