"""The output head as the grouped decoder runs it on CPU (``DecodingHead``): oneDNN with the weight packed once per
rollout, else a transposed product in cache-sized chunks; off the CPU it does nothing."""

from __future__ import annotations

import contextlib

import torch

HEAD_CHUNK = 8192  # vocabulary rows per product of the unpacked head (``DecodingHead``)


def _zero3_partitioned(weight: torch.Tensor) -> bool:
    return getattr(weight, "ds_id", None) is not None  # DeepSpeed gathers it around each call of its module


class DecodingHead:
    """The output head as the decoder runs it on CPU, where its few rows of logits against a 151,936-row head
    are most of a decode step. Measured at hidden 256 on this project's 2-core CPU, one [V, 256] head:

    - **oneDNN with the weight packed once per rollout** (``torch.ops.mkldnn._reorder_linear_weight``, as vLLM's
      CPU backend prepacks its linears): 8.2 ms for 8 rows, 12.3 ms for 16, the logits already [n, V];
    - **weight @ hidden^T** ([V, n], transposed 8,192 vocabulary rows at a time while still in cache): 12 and
      21 ms; it is the fallback (a weight partitioned by ZeRO-3, which DeepSpeed gathers around each call; a
      dtype or CPU oneDNN cannot pack, e.g. bfloat16 without AVX-512);
    - ``linear``'s hidden @ weight^T: 33-39 ms.

    The packed copy costs the head's size in memory for the rollout (64 ms to make here) and is dropped with the
    decoder; the weights do not change during a rollout. Installed as an instance ``forward`` (``installed()``),
    so module hooks (ZeRO-3's gathering) still run around it. Same product as ``linear``; only the order of
    summation may differ (measured: 1e-6 relative). Off the CPU it does nothing."""

    def __init__(self, model, rows_hint: int = 32):
        from app.grouping.modules import unwrap

        head = unwrap(model).get_output_embeddings()
        self.head, self.packed = head, None
        self.active = (isinstance(head, torch.nn.Linear) and head.weight.device.type == "cpu"
                       and "forward" not in head.__dict__)
        if self.active and not _zero3_partitioned(head.weight) and torch.backends.mkldnn.is_available():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(head.weight.detach(), rows_hint)
            except (RuntimeError, AttributeError):  # no oneDNN kernel for this dtype on this CPU
                self.packed = None

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.head
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self.packed is not None:
            out = torch.ops.mkldnn._linear_pointwise(flat.contiguous(), self.packed, head.bias, "none", [], "")
            return out.reshape(*hidden.shape[:-1], out.shape[-1])
        weight = head.weight
        out = flat.new_empty(flat.shape[0], weight.shape[0])
        for start in range(0, weight.shape[0], HEAD_CHUNK):  # [chunk, n] products, transposed while in cache
            out[:, start : start + HEAD_CHUNK] = (weight[start : start + HEAD_CHUNK] @ flat.T).T
        if head.bias is not None:
            out = out + head.bias
        return out.reshape(*hidden.shape[:-1], out.shape[-1])

    @contextlib.contextmanager
    def installed(self):
        if not self.active:
            yield
            return
        from app.grouping.modules import patched

        with patched(self.head, "forward", self._forward):
            yield

    def close(self) -> None:
        self.packed = None
