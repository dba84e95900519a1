"""Linear-attention (Gated DeltaNet) layers in a packed row: each segment continues its parent's recurrent state
and conv inputs. ``segments`` (whose state each run of the row continues, from the same layouts the attention
reads), ``kernels`` (the one adapter: flash-linear-attention's varlen kernels on CUDA, transformers' torch
fallback elsewhere), ``layer`` (the instance patch of each GDN layer, sequence-parallel over its heads too).
"""
