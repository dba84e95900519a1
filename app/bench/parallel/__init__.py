"""Benchmarks of layouts across processes (torchrun on this machine's cores, gloo): expert parallelism through
DeepSpeed's AutoEP against ZeRO-3 alone (``experts``: ``scripts/bench.sh ep``), each variant's processes measured
by a worker of their own (``worker``)."""
