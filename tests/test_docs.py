"""The pages under docs/ and the configs' comments, held to what they say: guidance in paragraphs of at most 800
characters (what to set first, how it was tested after), history on one page (docs/history.md, or git), every
``scripts/*.sh`` command naming options that exist (the trainer's config keys, the planner's and the GPU check's
flags, the benchmarks by name), every ``section.key`` a config key, every relative link a file (and heading), and
one folder layout for a model and Video-R1 (docs/quickstart.md's) in README, docs and configs alike."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.test_readme import anchors, config_keys, prose_paragraphs

ROOT = Path(__file__).resolve().parents[1]
GUIDES = [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in ("config.md",)]  # config.md: generated
CONFIGS = sorted(ROOT.glob("configs/**/*.yaml"))
SECTIONS = ("model", "lora", "data", "rollout", "forward", "grpo", "rewards", "sft", "train", "logging", "eval")
LAYOUT = ("/models/Qwen2.5-VL-7B-Instruct", "/data/Video-R1-data")  # docs/quickstart.md#get-a-model-and-data
HASH = re.compile(r"\b[0-9a-f]{7,12}\b")


def commands(text: str) -> list[str]:
    """Every ``scripts/NAME.sh ...`` command of a page: in code blocks (continued lines joined) and inline code."""
    start = re.compile(r"^(\w+=\S+ )*(bash |sbatch )?scripts/\w+\.(sh|sbatch)\b")
    out = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        out += [line.split(" #")[0] for line in joined.splitlines() if start.match(line.strip())]
    out += [code for code in re.findall(r"`([^`\n]+)`", text) if start.match(code)]
    return out


def plan_flags() -> set[str]:
    from app.planning import plan

    text = Path(plan.__file__).read_text()
    return set(re.findall(r'add_argument\("(--[\w-]+)"', text))


def gpu_check_flags() -> set[str]:
    from app.bench.gpu import check

    return set(re.findall(r'add_argument\("(--[\w-]+)"', Path(check.__file__).read_text()))


def benchmarks() -> set[str]:
    text = (ROOT / "scripts" / "bench.sh").read_text()
    names = {"all"}
    for group in re.findall(r"^\s+([\w|]+)\) (?:echo|exec)", text, re.M):
        names.update(group.split("|"))
    return names


def check_command(command: str, keys: set[str], where: str) -> None:
    words = [re.sub(r"^.*?(scripts/[\w./-]+).*$", r"\1", w) if "scripts/" in w else w for w in command.split()]
    script = next(w for w in words if w.startswith("scripts/"))
    assert (ROOT / script).exists(), f"{where}: {script} does not exist"
    after = words[words.index(script) + 1 :]
    for word in after:
        key = re.match(r"^([a-z_]+\.[a-z_0-9]+)=", word)
        if key and key.group(1).split(".")[0] in SECTIONS:
            assert key.group(1) in keys, f"{where}: {script} sets {key.group(1)}, which is no config key"
        flag = re.match(r"^(--[a-z][\w-]*)", word)
        if flag and script.endswith("plan.sh"):
            assert flag.group(1) in plan_flags(), f"{where}: plan.sh takes no {flag.group(1)}"
        if flag and script.endswith("gpu_check.sh"):
            assert flag.group(1) in gpu_check_flags(), f"{where}: gpu_check.sh takes no {flag.group(1)}"
    if script.endswith("bench.sh") and after and not after[0].startswith(("-", "<", "NAME", "[")):
        assert after[0].split("|")[0] in benchmarks(), f"{where}: bench.sh has no benchmark {after[0]}"


@pytest.mark.parametrize("page", GUIDES + [ROOT / "README.md"], ids=lambda p: p.name)
def test_guidance_paragraphs_are_short_and_hold_no_changelog(page):
    """At most 800 characters a paragraph (a list item is its own); commit hashes only on the history page."""
    text = page.read_text()
    for paragraph in prose_paragraphs(text):
        assert len(paragraph) <= 800, f"{page.name}: a paragraph of {len(paragraph)} characters: {paragraph[:100]}"
    if page.name != "history.md":
        for paragraph in prose_paragraphs(text):
            found = [h for h in HASH.findall(paragraph) if re.search(r"[a-f]", h) and re.search(r"\d", h)]
            assert not found, f"{page.name}: commit {found[0]} in guidance (history goes to docs/history.md)"


@pytest.mark.parametrize("page", GUIDES + CONFIGS + [ROOT / "README.md"], ids=lambda p: p.name)
def test_every_command_and_key_names_what_exists(page):
    keys = config_keys()
    text = page.read_text()
    for command in commands(text):
        check_command(command, keys, page.name)
    for key in re.findall(r"`([a-z_]+\.[a-z_0-9]+)(?:=[^`]*)?`", text):
        if key.split(".")[0] in SECTIONS and key.split(".")[1] not in ("sh", "md", "py", "yaml", "json"):
            assert key in keys, f"{page.name}: `{key}` is no config key"
    if page.suffix == ".yaml":
        for key in re.findall(r"\b([a-z_]+\.[a-z_0-9]+)=", text):
            if key.split(".")[0] in SECTIONS:
                assert key in keys, f"{page.name}: {key} is no config key"


@pytest.mark.parametrize("page", CONFIGS, ids=lambda p: p.name)
def test_the_configs_links_reach_a_page_and_its_heading(page):
    for target in re.findall(r"\b((?:docs/[\w/.-]+\.md|README\.md)(?:#[\w-]+)?)", page.read_text()):
        path, _, anchor = target.partition("#")
        assert (ROOT / path).exists(), f"{page.name}: {path} does not exist"
        if anchor:
            assert anchor in anchors(ROOT / path), f"{page.name}: no heading #{anchor} in {path}"
    assert "README section" not in page.read_text(), f"{page.name}: name the page and heading instead"


def test_one_folder_layout_for_a_model_and_its_data():
    """The model and Video-R1 live where docs/quickstart.md's "Get a model and data" puts them, in every page and
    7B config that names a path."""
    quick = (ROOT / "docs" / "quickstart.md").read_text()
    assert "## Get a model and data" in quick and all(p in quick for p in LAYOUT)
    for page in [ROOT / "README.md", *GUIDES, *CONFIGS]:
        text = page.read_text()
        for path in re.findall(r"(?<![\w.])(/(?:data|models)/[\w./-]+)", text):
            assert path.startswith(LAYOUT + ("/data/Video-R1-eval", "/models/")), f"{page.name}: {path}"


def test_the_hour_long_run_is_one_train_sh_command():
    scaling = (ROOT / "docs" / "scaling.md").read_text()
    hour = [c for c in commands(scaling) if "train.sh" in c and "data.max_frames=3600" in c]
    assert hour, "docs/scaling.md gives no scripts/train.sh command for the hour-long run"
    check_command(hour[0], config_keys(), "scaling.md")


def test_the_scripts_help_lines_name_flags_that_exist():
    """A launcher's header comment is its help: every --flag it lists is one its entry point takes."""
    for script, flags in (("plan.sh", plan_flags()), ("gpu_check.sh", gpu_check_flags())):
        header = "\n".join(line for line in (ROOT / "scripts" / script).read_text().splitlines() if line.startswith("#"))
        listed = set(re.findall(r"(--[a-z][\w-]+)", header))
        assert listed and listed <= flags | {"--help"}, (script, listed - flags)
