"""Benchmark code behind scripts/bench.sh: tables on stdout, JSON and PNG plots in an output folder."""
