"""The one adapter to the Gated DeltaNet kernels: the causal conv and the chunked delta rule over one level of a
packed row's segments (``segments.LevelIndex``), each segment from its own initial state.

- CUDA with flash-linear-attention installed (0.6.x, ``fla``): ``fla.modules.causal_conv1d.causal_conv1d`` and
  ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, one varlen call each per level (``cu_seqlens``) with a
  per-sequence ``initial_state`` (conv: [N, C, W], the last W - 1 inputs in the last columns; delta rule:
  [N, HV, K, V]); their backwards return the initial states' gradients (``dh0``). fla may dispatch the delta rule
  to FlashQLA on sm90 and later; its ``dh0`` is not checked here, so the adapter turns it off
  (``FLA_FLASH_QLA=0``, unless the user set the variable) and says so once.
- Elsewhere: the torch chunked delta rule (``chunk_gated_delta_rule``: transformers' ``torch_chunk_gated_delta_rule``
  with its in-chunk decays summed span by span, exact to float32 rounding however strong the decays) over the
  level's segments as padded rows, and the torch depthwise conv with each segment's parent's last W - 1 inputs in
  front. Pads carry k = v = q = 0, beta = 0 and g = 0, so a state passes
  through them unchanged and each row's final state is its segment's.

``level_kernels(device)`` picks one, feature-detected once; tests pass a stand-in of fla's signatures
(``FlaKernels(conv=..., rule=...)``) to drive the varlen wiring on CPU.

**One workaround, named here** (``use_accurate_fallback``): transformers' GDN layers call their modeling module's
``torch_chunk_gated_delta_rule`` in ordinary batches too (the repeated layout, HF generate's prefill), so its float32
loss (a decay parameter's gradient 3e-4..1e-3 from float64 on the tiny models' strong decays, where the span-sum
rule is within 5e-5) would be what the grouped row is compared with. The modeling modules of the GDN layers a model
holds get ``chunk_gated_delta_rule`` in its place for tensors off CUDA or without fla (transformers' own, fla
included, everywhere else): both layouts then run one kernel, and only the layout separates them.
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
def transformers_chunk_rule():
    """transformers' torch chunked delta rule, unwrapped from the decorator that would hand a CUDA-only fla kernel
    to a CPU tensor when fla is installed (and from ``use_accurate_fallback``'s, once a model was loaded)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)


def use_accurate_fallback(module) -> None:
    """Point the modeling module of GDN layer ``module`` at ``chunk_gated_delta_rule`` wherever it would run its torch
    fallback (idempotent): transformers' function still runs for CUDA tensors when fla is installed."""
    import sys

    owner = sys.modules[type(module).__module__]
    current = getattr(owner, "torch_chunk_gated_delta_rule", None)
    if current is None or getattr(current, "_prefix_grouping_accurate", False):
        return

    def rule(query, key, value, *args, _transformers=current, **kwargs):
        if query.device.type == "cuda" and fla_available():
            return _transformers(query, key, value, *args, **kwargs)
        kwargs.pop("cu_seqlens", None)  # one sequence per row here (transformers' fallback ignores it as well)
        return torch_chunk_rule()(query, key, value, *args, **kwargs)  # the grouped row's own (a test's, patched)

    rule._prefix_grouping_accurate = True
    rule.__wrapped__ = current  # transformers_chunk_rule still finds transformers' own
    owner.torch_chunk_gated_delta_rule = rule


def torch_chunk_rule():
    """The torch chunked delta rule the grouped forward runs where fla does not: ``chunk_gated_delta_rule`` below
    (transformers' algorithm and signature, its in-chunk decays summed span by span)."""
    return chunk_gated_delta_rule


def chunk_gated_delta_rule(query, key, value, g, beta, *, chunk_size: int = 64, initial_state=None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False, **kwargs):
    """transformers' ``torch_chunk_gated_delta_rule`` (same signature, shapes and float32 arithmetic) except for how
    it forms the decay between two positions i >= j of a chunk. transformers takes exp(c_i - c_j) of the float32
    cumulative sums c from the chunk's start: their difference carries the rounding of |c_i| (~|c| * 6e-8), which
    with strong decays (Qwen3.5's A up to 16: g of -10 to -100 a token) reaches hundreds or thousands, so a decay
    near 1 between neighbours comes out 1e-5..1e-4 wrong, the more so the later in its chunk a token falls (where
    the chunks fall is the only thing that changes it: the same rows shifted by 17 pads move a gradient 70x).
    Here each span's log-decay is summed over that span alone (``segsum``, as Mamba2 does), so its rounding scales
    with the decay itself: a kernel's outputs and g-gradients 1e-5 -> 2e-7 from float64 at g ~ -U(0, 30)."""
    dtype = query.dtype
    work = torch.float64 if dtype == torch.float64 else torch.float32  # float64 stays float64: a reference's
    batch, length, _, k_dim = key.shape
    v_heads, v_dim = value.shape[-2:]
    query, key, value, beta, g = (x.transpose(1, 2).to(work, memory_format=torch.contiguous_format)
                                  for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        query = query * torch.rsqrt((query * query).sum(-1, keepdim=True) + 1e-6)
        key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
    query = query * query.shape[-1] ** -0.5
    pad = (chunk_size - length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta, k_beta = value * beta.unsqueeze(-1), key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = (x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1])
                                  for x in (query, key, k_beta, v_beta))
    g = g.reshape(g.shape[0], g.shape[1], -1, chunk_size)
    below = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).tril(-1)
    # span[..., i, j] = sum of g over j < t <= i (0 on and above the diagonal): one cumulative sum per span
    span = g.unsqueeze(-1).expand(*g.shape, chunk_size).masked_fill(~below, 0.0).cumsum(-2)
    pairwise = span.masked_fill(below.T, float("-inf")).exp()  # [.., i, j]: the decay from j to i (0 where j > i)
    from_start = g.cumsum(-1)  # log-decay from the chunk's start (its exp is tiny wherever its rounding is large)
    to_end = span[..., -1, :]  # log-decay from each position to the chunk's end
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, k_beta * from_start.exp().unsqueeze(-1), upper=False,
                                               unitriangular=True)
    state = (torch.zeros(batch, v_heads, k_dim, v_dim, dtype=new_values.dtype, device=new_values.device)
             if initial_state is None else initial_state.to(new_values))
    query = query * from_start.exp().unsqueeze(-1)
    key = key * to_end.exp().unsqueeze(-1)
    chunk_decay = from_start[..., -1].exp()[..., None, None]
    out = torch.zeros_like(new_values)
    for i in range(new_values.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = query[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(batch, v_heads, -1, v_dim)[:, :, :length]
    return (out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format),
            state if output_final_state else None)


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
