"""Video-encoding benchmarks: questions sharing one video against k separate groups (``shared_video``: decode, tower,
prefill, decode steps, policy and reference passes, with the planner's FLOP ratio) and the per-step vision cache
(``vision_cache``)."""
