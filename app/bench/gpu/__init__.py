"""The GPU acceptance (``scripts/gpu_check.sh``): the runner (``check``), its parts (``real_shape``, ``decode``,
``rehearsal``) and the report (``report``)."""
