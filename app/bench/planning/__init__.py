"""The planner against measurement: ``accuracy`` (planned vs the allocator's peak, and FLOPs, on unseen shapes)."""
