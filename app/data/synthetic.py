"""Synthetic video QA: short mp4s of moving coloured shapes with questions only the video can answer.

    python -m app.data.synthetic --out data/synthetic --train 400 --heldout 120 --seed 0

Deterministic from the seed. Writes ``videos/*.mp4``, ``train.jsonl`` and ``heldout.jsonl`` in Video-R1's schema.
Held-out questions use videos never seen in training. ``--questions-per-video N`` > 1: each clip (squares of one
colour moving together) is asked N questions in turn (its colour, its direction, how many squares), as video QA
sets ask several questions of one video (for ``data.questions_per_video``).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np

from app.data.video import write_mp4

COLOURS = {"red": (220, 30, 30), "green": (30, 190, 40), "blue": (30, 60, 230), "yellow": (235, 220, 30)}
DIRECTIONS = ("left", "right", "up", "down")
TASKS = ("colour", "direction", "count", "motion", "order", "glimpse")
GLIMPSE_QUESTION = "A colour shows for a moment under a white bar. Which colour is it?"
GLIMPSE_OVERVIEW_FRAMES = 8  # the overview the glimpse task hides its colour from (configs/demo_tools_cpu.yaml's)


def render(colours: list[str], direction: str, frames: int, size: int, rng: random.Random,
           side: int | None = None) -> np.ndarray:
    """Squares of the given colours moving together in one direction over a dark background."""
    video = np.full((frames, size, size, 3), 16, dtype=np.uint8)
    side = side or max(6, size // 5)
    step = (size - side) // max(frames - 1, 1)
    dx, dy = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}[direction]
    starts = []
    for i, _ in enumerate(colours):
        lane = (i * (side + 2)) % max(size - side, 1)
        if dx:
            starts.append((0 if dx > 0 else size - side, lane))
        else:
            starts.append((lane, 0 if dy > 0 else size - side))
    for t in range(frames):
        for (x0, y0), name in zip(starts, colours):
            x, y = x0 + dx * step * t, y0 + dy * step * t
            video[t, y : y + side, x : x + side] = COLOURS[name]
    return video


def render_motion(direction: str, frames: int, size: int, rng: random.Random) -> np.ndarray:
    """One grey square that starts at a random place and moves half the frame in ``direction``: any single frame
    fits every direction, so the answer needs at least two frames (the question that needs time)."""
    video = np.full((frames, size, size, 3), 16, dtype=np.uint8)
    side = size // 4
    travel = (size - side) // 2
    step = travel / max(frames - 1, 1)
    dx, dy = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}[direction]
    along = rng.randint(0, size - side - travel)  # where the path starts on the motion axis (fits the frame)
    across = rng.randint(0, size - side)
    start = along if (dx or dy) > 0 else along + travel
    for t in range(frames):
        offset = round(start + (dx or dy) * step * t)
        x, y = (offset, across) if dx else (across, offset)
        video[t, y : y + side, x : x + side] = 200
    return video


def render_order(first: str, second: str, frames: int, size: int, rng: random.Random) -> np.ndarray:
    """A big square of colour ``first`` in the first half of the clip, then one of colour ``second`` (each at a
    random place): every frame shows one colour, so which came first is only known by comparing frames in time."""
    video = np.full((frames, size, size, 3), 16, dtype=np.uint8)
    side = size // 2
    half = frames // 2
    for colour, span in ((first, range(half)), (second, range(half, frames))):
        x, y = rng.randint(0, size - side), rng.randint(0, size - side)
        for t in span:
            video[t, y : y + side, x : x + side] = COLOURS[colour]
    return video


def glimpse_window(frames: int) -> int:
    """Frames the glimpse task's white bar shows for: a quarter of the clip (2 s of an 8 s clip at 4 fps), so that an
    overview at 1 fps catches the bar."""
    return max(1, frames // 4)


def overview_indices(frames: int, sampled: int) -> set[int]:
    """The frames an overview of ``sampled`` frames takes from a clip of ``frames``: qwen-vl-utils' evenly spaced
    indices, computed as it computes them."""
    import torch

    return set(torch.linspace(0, frames - 1, sampled).round().long().tolist())


def render_glimpse(colour: str, frames: int, size: int, rng: random.Random,
                   overview: int = GLIMPSE_OVERVIEW_FRAMES) -> tuple[np.ndarray, int]:
    """The task that needs a tool: a dark clip in which, for ``glimpse_window`` frames at a random time, a white bar
    lines the top (the cue: wide enough to see in an overview's few pixels) and, on those frames of the window an
    overview of ``overview`` frames does not take, the frame below the bar is ``colour``. The overview shows when
    to look and never the colour; frames of the window at a higher rate show it plainly. Returns the clip and the
    first frame of the window. (``rng`` draws the window's place.)"""
    video = np.full((frames, size, size, 3), 16, dtype=np.uint8)
    window = glimpse_window(frames)
    first = rng.randint(0, frames - window)
    bar = max(2, size // 8)
    hidden = overview_indices(frames, overview)
    for t in range(first, first + window):
        video[t, :bar] = 235
        if t not in hidden:
            video[t, bar + 2 :] = COLOURS[colour]
    return video, first


def make_item(index: int, task: str, rng: random.Random, out: Path, *, frames: int, size: int, fps: int,
              shuffle_options: bool = True) -> dict:
    direction = rng.choice(DIRECTIONS)
    if task == "count":
        count = rng.randint(1, 4)
        colours = [rng.choice(list(COLOURS)) for _ in range(count)]
    elif task == "order":
        colours = rng.sample(list(COLOURS), 2)
    else:
        colours = [rng.choice(list(COLOURS))]
    path = Path("videos") / f"clip{index:05d}.mp4"
    side = size // 2 if task == "colour" else None  # one big square: colour fills much of the frame
    if task == "motion":
        clip = render_motion(direction, frames, size, rng)
    elif task == "order":
        clip = render_order(colours[0], colours[1], frames, size, rng)
    elif task == "glimpse":
        clip, first = render_glimpse(colours[0], frames, size, rng)
    else:
        clip = render(colours, direction, frames, size, rng, side)
    write_mp4(out / path, clip, fps=fps)
    letters = "ABCD"
    if task == "colour":
        options, answer = list(COLOURS), colours[0]
        question = "What colour is the moving square?"
    elif task == "glimpse":
        options, answer = list(COLOURS), colours[0]
        question = GLIMPSE_QUESTION
    elif task == "order":
        options, answer = list(COLOURS), colours[0]
        question = "Which colour appears first?"
    elif task in ("direction", "motion"):
        options, answer = list(DIRECTIONS), direction
        question = "Which way does the square move?"
    else:
        options, answer = ["1", "2", "3", "4"], str(len(colours))
        question = "How many squares are in the video?"
    if shuffle_options:
        rng.shuffle(options)
    letter = letters[options.index(answer)]
    extra = {}
    if task == "glimpse":  # where the bar is, in seconds: for checks and plots, never shown to the model
        extra = {"duration": frames / fps, "glimpse": [first / fps, (first + glimpse_window(frames)) / fps]}
    return {
        "problem_id": index,
        "problem": question,
        "data_type": "video",
        "problem_type": "multiple choice",
        "options": [f"{letters[i]}. {o}" for i, o in enumerate(options)],
        "solution": f"<answer>{letter}</answer>",
        "path": str(path),
        "data_source": f"synthetic/{task}",
        **extra,
    }


SHARED_QUESTIONS = (("colour", "What colour are the squares?"), ("direction", "Which way do the squares move?"),
                    ("count", "How many squares are in the video?"))


def make_video_questions(index: int, clip_index: int, count: int, rng: random.Random, out: Path, *, frames: int,
                         size: int, fps: int, keyframe_interval: int = 0) -> list[dict]:
    """``count`` records on one clip (1-3 squares of one colour moving together): its colour, direction and
    number of squares asked in turn (options shuffled each time), problem ids from ``index``."""
    colour, direction, squares = rng.choice(list(COLOURS)), rng.choice(DIRECTIONS), rng.randint(1, 3)
    path = Path("videos") / f"clip{clip_index:05d}.mp4"
    write_mp4(out / path, render([colour] * squares, direction, frames, size, rng), fps=fps,
              keyframe_interval=keyframe_interval)
    answers = {"colour": (list(COLOURS), colour), "direction": (list(DIRECTIONS), direction),
               "count": (["1", "2", "3", "4"], str(squares))}
    records = []
    for q in range(count):
        task, question = SHARED_QUESTIONS[q % len(SHARED_QUESTIONS)]
        options, answer = list(answers[task][0]), answers[task][1]
        rng.shuffle(options)
        records.append({"problem_id": index + q, "problem": question, "data_type": "video",
                        "problem_type": "multiple choice",
                        "options": [f"{'ABCD'[i]}. {o}" for i, o in enumerate(options)],
                        "solution": f"<answer>{'ABCD'[options.index(answer)]}</answer>", "path": str(path),
                        "data_source": f"synthetic/shared_{task}"})
    return records


def generate(out: str | Path, train: int, heldout: int, seed: int = 0, tasks: tuple[str, ...] = TASKS, *,
             frames: int = 8, size: int = 56, fps: int = 4, shuffle_options: bool = True,
             heldout_tasks: tuple[str, ...] | None = None,
             questions_per_video: int | tuple[int, ...] = 1, keyframe_interval: int = 0) -> dict[str, Path]:
    """``tasks`` alternate over the training records, ``heldout_tasks`` (default: the same) over the held-out ones.
    ``questions_per_video`` > 1: ``train`` / ``heldout`` records asked of clips of their own, that many per clip
    (``make_video_questions``; ``tasks`` then unused); a tuple gives each clip's count in turn (uneven runs), and
    ``keyframe_interval`` > 0 puts a keyframe every that many frames in their clips (x264's default otherwise)."""
    out = Path(out)
    (out / "videos").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    files = {}
    index = 0
    counts = tuple(questions_per_video) if isinstance(questions_per_video, (tuple, list)) else (questions_per_video,)
    shared = isinstance(questions_per_video, (tuple, list)) or questions_per_video > 1
    for split, count in (("train", train), ("heldout", heldout)):
        records = []
        kinds = tasks if split == "train" else (heldout_tasks or tasks)
        clips = 0
        while shared and len(records) < count:
            many = min(counts[clips % len(counts)], count - len(records))
            records += make_video_questions(index, index, many, rng, out, frames=frames, size=size, fps=fps,
                                            keyframe_interval=keyframe_interval)
            index, clips = index + many, clips + 1
        for i in range(0 if shared else count):
            records.append(make_item(index, kinds[i % len(kinds)], rng, out, frames=frames, size=size, fps=fps,
                                     shuffle_options=shuffle_options))
            index += 1
        path = out / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        files[split] = path
    (out / "meta.json").write_text(json.dumps({"seed": seed, "train": train, "heldout": heldout,
                                               "tasks": list(tasks), "heldout_tasks": list(heldout_tasks or tasks),
                                               "frames": frames, "size": size, "fps": fps,
                                               "shuffle_options": shuffle_options,
                                               "questions_per_video": questions_per_video if isinstance(questions_per_video, int)
                                               else list(questions_per_video)}))
    return files


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/synthetic")
    parser.add_argument("--train", type=int, default=400)
    parser.add_argument("--heldout", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated subset of {TASKS}")
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--size", type=int, default=56)
    parser.add_argument("--fixed-options", action="store_true", help="keep options in one order (A. red ...)")
    parser.add_argument("--questions-per-video", type=int, default=1, help="questions asked of each clip (>1: its "
                        "colour, direction and count in turn)")
    args = parser.parse_args(argv)
    tasks = tuple(t for t in args.tasks.split(",") if t)
    unknown = set(tasks) - set(TASKS)
    if unknown:
        parser.error(f"unknown task(s) {sorted(unknown)}; choose from {TASKS}")
    files = generate(args.out, args.train, args.heldout, args.seed, tasks, frames=args.frames, size=args.size,
                     shuffle_options=not args.fixed_options, questions_per_video=args.questions_per_video)
    print(json.dumps({k: str(v) for k, v in files.items()}))


if __name__ == "__main__":
    main()
