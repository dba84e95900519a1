"""Checks that the grouped layout is right on the run's own model and data: the self-check (``selfcheck``: grouped
against repeated on one batch, in float32 exactly and in low precision against a float32 forward).

May import: ``app.grouping``'s own modules (torch and transformers only).
"""
