"""Which questions a rank evaluates and in which batches: with ``eval.share_video`` the questions on one video (or
image) travel together, to one rank and one batch, their media decoded once and marked as shared (so the grouped
engine prefills the video once for them: ``app.grouping.decoding.shared``)."""

from __future__ import annotations

from app.data.records import encode_record, encode_run, media_key


def question_runs(usable: list[dict], ev) -> list[list[dict]]:
    """The units of work ranks take in turn: with ``eval.share_video`` the questions on one video (or image), in
    the order the files first name it, cut at ``eval.batch_size``; else every question alone."""
    if not ev.share_video:
        return [[r] for r in usable]
    runs: dict = {}
    for i, record in enumerate(usable):
        key = media_key(record, record["_root"])
        runs.setdefault(("record", i) if key is None else key, []).append(record)
    return [run[j : j + ev.batch_size] for run in runs.values() for j in range(0, len(run), ev.batch_size)]


def question_batches(mine: list[dict], ev) -> list[list[list[dict]]]:
    """This rank's questions, ``eval.batch_size`` at a time, as runs on one video (``question_runs``) that never
    straddle two batches."""
    batches, size = [], 0
    for run in question_runs(mine, ev):
        if not batches or size + len(run) > ev.batch_size:
            batches.append([])
            size = 0
        batches[-1].append(run)
        size += len(run)
    return batches


def encoded(processor, runs: list[list[dict]], data_cfg, engine_view: bool, share: bool) -> list[tuple]:
    """(record, prompt or None, reason) for a batch's runs: each run's media decoded once (``encode_run``: its
    prompts marked as sharing it) when ``share``, else each record on its own."""
    out = []
    for run in runs:
        if share:
            results, _ = encode_run(processor, run, run[0]["_root"], data_cfg, engine_view)
        else:
            results = [encode_record(processor, r, r["_root"], data_cfg, engine_view=engine_view) for r in run]
        out += [(record, prompt, reason) for record, (prompt, reason) in zip(run, results)]
    return out
