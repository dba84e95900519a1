"""The per-rank prompt stream: a deterministic, resumable order of records (reshuffled each epoch), encoded on the
critical path or prefetched in background threads, with skips counted and named; and ``load_stream``, which reads,
checks and reports a training file and builds this rank's stream.

``data.questions_per_video`` = k > 1: records on the same media (file, data type, a frame folder's own settings)
come as runs of up to k consecutive questions (``run_order``), each run's media decoded once and its prompts
marked as sharing it (``records.encode_run``), so the rollout and the training forward can hold the video once.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from app.data.records import (
    SKIP_EXAMPLES,
    DataError,
    EncodedPrompt,
    Skipped,
    check_record,
    encode_record,
    encode_run,
    media_key,
    media_paths,
    read_records,
    where,
)

log = logging.getLogger("app.data.records")


def run_order(keys: list, k: int, shuffle: bool, *, seed: int, epoch: int, rank: int, world: int) -> list[list[int]]:
    """This rank's runs for ``epoch``: record indices grouped by media key (None: a run of its own), each key's
    records cut into runs of at most ``k`` (shuffled within the key first, then the runs shuffled, when
    ``shuffle``; else in file order), every ``world``-th run from ``rank``. Every record is in exactly one rank's
    runs per epoch; a run never spans ranks."""
    rng = random.Random(seed * 1_000_003 + epoch)
    by_key: dict = {}
    for i, key in enumerate(keys):
        by_key.setdefault(("record", i) if key is None else key, []).append(i)
    runs = []
    for members in by_key.values():
        members = list(members)
        if shuffle:
            rng.shuffle(members)
        runs += [members[j : j + k] for j in range(0, len(members), k)]
    if shuffle:
        rng.shuffle(runs)
    return runs[rank::world]


def media_count(record: dict, data_root: Path) -> int:
    """The media files a record's prompt decodes."""
    return len(media_paths(record, data_root)) if record.get("data_type") in ("image", "video") and \
        record.get("path") else 0


@dataclass
class PromptStream:
    """Deterministic, resumable stream of encoded prompts for one rank (records i = rank mod world per epoch; with
    ``questions_per_video`` k > 1, runs of up to k records on the same media, every world-th run: ``run_order``).

    ``lookahead`` > 0: the next ``lookahead`` positions are decoded and encoded in ``workers`` background threads
    while the caller works (decord and the processor release the GIL for most of it). What a position holds is a
    function of the position alone, so the order, the skips (counted when their position is consumed, once) and a
    resume from ``position`` are those of the plain stream; at most ``lookahead`` prompts wait in memory.
    """

    records: list[dict]
    data_root: Path
    data_cfg: object
    processor: object
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    position: int = 0  # prompts of this rank's stream consumed so far (encoded or skipped)
    skipped: Counter = field(default_factory=Counter)  # reason -> count, from loading and from encoding
    total_records: int = 0
    lookahead: int = 0
    workers: int = 2
    engine_views: bool = False  # keep each prompt's media for an engine with its own processor (rollout.engine=vllm)
    wait_seconds: float = 0.0  # time next_prompts spent decoding / waiting for prompts (reset by the caller)
    recent_skips: Counter = field(default_factory=Counter)  # skips since the caller last took them (take_skips)
    _warned: set = field(default_factory=set, repr=False)
    _pending: dict = field(default_factory=dict, repr=False)  # position -> Future[(prompt | None, reason)]
    _pool: ThreadPoolExecutor | None = field(default=None, repr=False)
    _epoch_order: tuple = field(default=(None, []), repr=False)
    questions_per_video: int = 1  # data.questions_per_video: runs of up to k questions on the same media
    decodes: int = 0  # media files decoded for the prompts consumed since the caller took them (take_decodes)
    _keys: list | None = field(default=None, repr=False)
    _runs: dict = field(default_factory=dict, repr=False)  # epoch -> (record indices, per index its run's bounds)
    _run_cache: tuple = field(default=(None, None), repr=False)  # (run id, its encoded results)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # held by every prefetch job while it works and by ``paused`` (a CUDA graph capture): no job runs meanwhile
    _quiet: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # the dtype the vision tower reads (bf16 in a bf16 run): pixels are kept in it from encoding on, on the host and
    # in prefetch (the model casts them to it anyway: the same bits), half of float32's bytes
    pixel_dtype: object = None
    # (rank, S): decode only that sequence-parallel rank's share of each video (app.data.shares); None: whole
    sp_share: tuple | None = None
    # with sp_share: (this rank's result for a position: True when it made the prompt) -> True when every rank
    # of its group did (``ParallelContext.all_in_group``), called once per position on every rank of the group
    agree: object = None

    def _order(self, epoch: int) -> list[int]:
        """This rank's record indices for ``epoch``; the last epoch's is kept (a shuffle of Video-R1-260k takes
        ~70 ms, and every prompt, prefetched or not, looks its record up)."""
        if self._epoch_order[0] != epoch:
            order = list(range(len(self.records)))
            if self.data_cfg.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            usable = len(order) - len(order) % self.world_size if len(order) >= self.world_size else len(order)
            self._epoch_order = (epoch, order[:usable][self.rank :: self.world_size])
        return self._epoch_order[1]

    def _epoch_runs(self, epoch: int) -> tuple[list[int], list[tuple[int, int]]]:
        """k > 1: this rank's record indices for ``epoch`` (runs one after another) and, per index, its run's
        (start, end) indices. The last few epochs are kept."""
        if epoch not in self._runs:
            if self._keys is None:
                self._keys = [media_key(r, self.data_root) for r in self.records]
            runs = run_order(self._keys, self.questions_per_video, self.data_cfg.shuffle, seed=self.seed, epoch=epoch,
                             rank=self.rank, world=self.world_size)
            order, bounds = [], []
            for run in runs:
                bounds += [(len(order), len(order) + len(run))] * len(run)
                order += run
            if len(self._runs) > 4:
                self._runs.pop(min(self._runs))
            self._runs[epoch] = (order, bounds)
        return self._runs[epoch]

    def _locate(self, position: int) -> tuple[int, int]:
        """k > 1: (epoch, index) of a position; a rank's epochs differ in length (runs differ in size)."""
        epoch, start = 0, 0
        while True:
            length = len(self._epoch_runs(epoch)[0])
            if length == 0:
                raise DataError("no usable records for this rank")
            if position < start + length:
                return epoch, position - start
            start, epoch = start + length, epoch + 1

    def _run_at(self, position: int) -> tuple[tuple, list[dict], int]:
        """k > 1: (the run's id, its records, this position's place in it)."""
        epoch, index = self._locate(position)
        order, bounds = self._epoch_runs(epoch)
        start, end = bounds[index]
        return (epoch, start), [self.records[i] for i in order[start:end]], index - start

    def _record_at(self, position: int) -> dict:
        if self.questions_per_video > 1:
            run, records, i = self._run_at(position)
            return records[i]
        cached = self._epoch_order[0]  # every epoch has the same length: measure the one at hand
        per_epoch = len(self._order(0 if cached is None else cached))
        if per_epoch == 0:
            raise DataError("no usable records for this rank")
        epoch, index = divmod(position, per_epoch)
        return self.records[self._order(epoch)[index]]

    def skip(self, record: dict, reason: str) -> None:
        """Count a skip; warn the first time a record is skipped (later epochs only count it): the first
        ``SKIP_EXAMPLES`` on the console, every one in the rank's log file."""
        key = where(record)
        if key not in self._warned:
            self._warned.add(key)
            detail = len(self._warned) > SKIP_EXAMPLES
            log.warning("skipping %s: %s%s", key, reason, "" if len(self._warned) != SKIP_EXAMPLES else
                        " (further skipped records are named in this rank's log file only)",
                        extra={"detail": detail})
        kind = skip_kind(reason)
        self.skipped[kind] += 1
        self.recent_skips[kind] += 1
        limit = self.data_cfg.max_skip_fraction * max(self.total_records, 1)
        if sum(self.skipped.values()) > limit:
            raise DataError(
                f"{sum(self.skipped.values())} of {self.total_records} records are unusable, "
                f"more than data.max_skip_fraction={self.data_cfg.max_skip_fraction}; last: {where(record)}: {reason}"
            )

    def encode(self, record: dict, shuffle_frames_seed: int | None = None, epoch: int = 0) -> EncodedPrompt | None:
        prompt, reason = self._encoded(record, shuffle_frames_seed)
        if prompt is None:
            self.skip(record, reason)
        return None if prompt is None else replace(prompt, epoch=epoch)

    def _encoded(self, record: dict, shuffle_frames_seed: int | None = None) -> tuple[EncodedPrompt | None, str]:
        return self._in_dtype(encode_record(self.processor, record, self.data_root, self.data_cfg,
                                            shuffle_frames_seed, self.engine_views, sp_share=self.sp_share))

    def _agreed(self, prompt: EncodedPrompt | None, reason: str) -> tuple[EncodedPrompt | None, str]:
        """A position's result as its whole sequence-parallel group takes it (``agree``: ranks decoding their
        own shares may fail apart; a prompt one rank could not make is skipped by all)."""
        if self.agree is None or self.agree(prompt is not None) or prompt is None:
            return prompt, reason
        return None, ("undecodable video: another rank of this sequence-parallel group could not decode its share "
                      "(its log names the file and frames)")

    def epoch_of(self, position: int) -> int:
        """The epoch the stream position ``position`` falls in (each usable record once per epoch over all ranks)."""
        if self.questions_per_video > 1:
            return self._locate(position)[0]
        cached = self._epoch_order[0]
        return position // max(1, len(self._order(0 if cached is None else cached)))

    def _run_results(self, run: tuple, records: list[dict]) -> list:
        """k > 1: a run's encoded prompts, from the run at hand, its prefetch, or encoded now (its decodes counted
        the first time the run is reached)."""
        if self._run_cache[0] != run:
            ahead: Future | None = self._pending.pop(run, None)
            results, decodes = ahead.result() if ahead is not None else self._in_dtype(encode_run(
                self.processor, records, self.data_root, self.data_cfg, self.engine_views, sp_share=self.sp_share))
            self._run_cache = (run, results)
            with self._lock:
                self.decodes += decodes
        return self._run_cache[1]

    def take_decodes(self) -> int:
        """Media files decoded for the prompts taken since the last call (``data/media_decoded``)."""
        with self._lock:
            taken, self.decodes = self.decodes, 0
        return taken

    def next_prompts(self, count: int) -> list[EncodedPrompt]:
        start = time.perf_counter()
        out: list[EncodedPrompt] = []
        while self.questions_per_video > 1 and len(out) < count:
            run, records, i = self._run_at(self.position)
            prompt, reason = self._agreed(*self._run_results(run, records)[i])
            self.position += 1
            if prompt is None:
                self.skip(records[i], reason)
            else:
                out.append(replace(prompt, epoch=run[0]))
        while len(out) < count:
            record = self._record_at(self.position)
            epoch = self.epoch_of(self.position)
            ahead: Future | None = self._pending.pop(self.position, None)
            self.position += 1
            with self._lock:
                self.decodes += media_count(record, self.data_root)
            prompt, reason = self._agreed(*(self._encoded(record) if ahead is None else ahead.result()))
            if prompt is None:
                self.skip(record, reason)
            else:
                out.append(replace(prompt, epoch=epoch))
        self.prefetch()
        self.wait_seconds += time.perf_counter() - start
        return out

    def take_skips(self) -> Counter:
        """The skips since the last call, by reason (for a one-line summary per step)."""
        taken, self.recent_skips = self.recent_skips, Counter()
        return taken

    def prefetch(self) -> None:
        """Start encoding the next ``lookahead`` positions (drop any a resume moved behind ``position``)."""
        if self.lookahead <= 0:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max(1, self.workers), thread_name_prefix="prefetch")
        if self.questions_per_video > 1:  # one job per run, shared by its positions
            ahead = [self._run_at(p) for p in range(self.position, self.position + self.lookahead)]
            wanted = {run for run, _, _ in ahead}
            for stale in [r for r in self._pending if r not in wanted]:
                self._pending.pop(stale).cancel()
            for run, records, _ in ahead:
                if run not in self._pending and run != self._run_cache[0]:
                    self._pending[run] = self._pool.submit(self._quietly, encode_run, self.processor, records,
                                                           self.data_root, self.data_cfg, self.engine_views,
                                                           sp_share=self.sp_share)
            return
        for stale in [p for p in self._pending if p < self.position]:
            self._pending.pop(stale).cancel()
        for position in range(self.position, self.position + self.lookahead):
            if position not in self._pending:
                self._pending[position] = self._pool.submit(
                    self._quietly, encode_record, self.processor, self._record_at(position), self.data_root,
                    self.data_cfg, None, self.engine_views, sp_share=self.sp_share)

    def _quietly(self, work, *args, **kwargs):
        with self._quiet:
            return self._in_dtype(work(*args, **kwargs))

    def _in_dtype(self, result):
        """An encode's result ((prompt, reason), or a run's ([(prompt, reason)...], decodes)) with its pixels in
        ``pixel_dtype`` (``pixels_in``); prompts that shared a tensor still share one."""
        if self.pixel_dtype is None:
            return result
        memo: dict = {}
        if isinstance(result[0], list):
            return [(pixels_in(p, self.pixel_dtype, memo), reason) for p, reason in result[0]], result[1]
        return pixels_in(result[0], self.pixel_dtype, memo), result[1]

    @contextmanager
    def paused(self):
        """While inside, no prefetch job runs (the one under way is waited for): a CUDA graph being captured on this
        process's device sees no other thread's device work (decoders, processors and libraries they call)."""
        with self._quiet:
            yield

    def close(self) -> None:
        """Stop the background workers (waiting for the encodes under way)."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def skip_kind(reason: str) -> str:
    return reason.split(":")[0].split(" (")[0]


def report_skips(skipped: list[Skipped], total: int, source: str, skip_log: Path | None) -> None:
    """One summary of the records refused at load, by reason, with the first few examples; the full list (one JSON
    line per record) goes to ``skip_log``. Called on one rank only."""
    if not skipped:
        return
    counts = Counter(skip_kind(s.reason) for s in skipped)
    examples = "; ".join(f"{s.where}: {s.reason}" for s in skipped[:SKIP_EXAMPLES])
    where_all = ""
    if skip_log is not None:
        skip_log.parent.mkdir(parents=True, exist_ok=True)
        skip_log.write_text("".join(json.dumps({"where": s.where, "reason": s.reason}) + "\n" for s in skipped))
        where_all = f"; every one is listed in {skip_log}"
    log.warning("%d of %d records in %s cannot be used and are skipped (%s). First %d: %s%s", len(skipped), total,
                source, ", ".join(f"{kind}: {n}" for kind, n in counts.most_common()), min(len(skipped),
                SKIP_EXAMPLES), examples, where_all)


def pixels_in(prompt: EncodedPrompt | None, dtype, memo: dict) -> EncodedPrompt | None:
    """``prompt`` with its floating pixel tensors in ``dtype`` (each tensor cast once: ``memo``, id -> cast)."""
    if prompt is None:
        return None
    inputs = dict(prompt.inputs)
    for key in ("pixel_values", "pixel_values_videos"):
        value = inputs.get(key)
        if value is not None and value.is_floating_point() and value.dtype != dtype:
            if id(value) not in memo:
                memo[id(value)] = (value, value.to(dtype))  # the source kept alive: its id stays its own
            inputs[key] = memo[id(value)][1]
    return replace(prompt, inputs=inputs)


def load_stream(data_cfg, processor, seed: int, rank: int, world_size: int, *, lookahead: int = 0,
                skip_log: Path | None = None, engine_views: bool = False, pixel_dtype=None, sp_share=None,
                agree=None) -> PromptStream:
    """This rank's stream of ``data_cfg.train_file``. Records that cannot be used are counted on every rank and
    reported once, by rank 0 (``report_skips``). ``sp_share`` / ``agree``: ``PromptStream``'s (share decoding)."""
    records, skipped = read_records(data_cfg.train_file)
    data_root = Path(data_cfg.data_root) if data_cfg.data_root else Path(data_cfg.train_file).parent
    usable = []
    for record in records:
        reason = check_record(record, data_root, data_cfg.confine_to_root)
        if reason:
            skipped.append(Skipped(where(record), reason))
        else:
            usable.append(record)
    total = len(records) + sum(1 for s in skipped if "malformed" in s.reason or "not a JSON" in s.reason)
    if rank == 0:
        report_skips(skipped, total, str(data_cfg.train_file), skip_log)
    if total and len(skipped) > data_cfg.max_skip_fraction * total:
        raise DataError(f"{len(skipped)} of {total} records in {data_cfg.train_file} are unusable (more than "
                        f"data.max_skip_fraction={data_cfg.max_skip_fraction}); first: {skipped[0].where}: "
                        f"{skipped[0].reason}")
    if not usable:
        raise DataError(f"{data_cfg.train_file}: no usable records")
    reasons = Counter(skip_kind(s.reason) for s in skipped)
    return PromptStream(usable, data_root, data_cfg, processor, seed=seed, rank=rank, world_size=world_size,
                        skipped=reasons, total_records=total, lookahead=lookahead,
                        workers=getattr(data_cfg, "prefetch_workers", 2), engine_views=engine_views,
                        questions_per_video=getattr(data_cfg, "questions_per_video", 1), pixel_dtype=pixel_dtype,
                        sp_share=sp_share, agree=agree if sp_share else None)
