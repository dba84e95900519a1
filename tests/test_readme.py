"""README as a front page: short (an opening of at most 12 lines, no prose paragraph over 600 characters, a Tests
section of three lines), and true: every link reaches a file (and heading), every command names scripts, configs,
make targets and config keys that exist, and its figures are the ones its sources measured."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())  # underscores stay (github-slugger keeps them)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in path.read_text().splitlines() if re.match(r"#{1,6} ", line)}


def prose_paragraphs(text: str) -> list[str]:
    """Paragraphs outside code blocks and tables, each list item on its own."""
    out, current, code = [], [], False
    for line in text.splitlines():
        fence = line.startswith("```")
        if fence:
            code = not code
        if fence or code or line.lstrip().startswith(("|", "#", "![")) or not line.strip():
            if current:
                out.append(" ".join(current))
            current = []
            continue
        if re.match(r"^\s{0,4}(- |\d+\. )", line) and current:
            out.append(" ".join(current))
            current = []
        current.append(line.strip())
    if current:
        out.append(" ".join(current))
    return out


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_link_reaches_a_file_and_its_heading(page):
    text = page.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: link to {target} (no such file)"
        if anchor and file.suffix == ".md":
            assert anchor in anchors(file), f"{page.name}: link to {target} (no such heading in {file.name})"


def config_keys() -> set[str]:
    from app.config.sections import Config

    config = Config()
    return {f"{section.name}.{f.name}" for section in dataclasses.fields(Config)
            for f in dataclasses.fields(getattr(config, section.name))}


def test_every_command_names_what_exists():
    keys = config_keys()
    targets = set(re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), re.M))
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    assert blocks
    seen = {"scripts": 0, "configs": 0, "keys": 0, "make": 0}
    for block in blocks:
        for line in block.splitlines():
            if line.strip().startswith("#"):
                continue
            for path in re.findall(r"\b((?:scripts|configs)/[\w./-]+\.(?:sh|yaml|sbatch))", line):
                assert (ROOT / path).exists(), f"README names {path}, which does not exist"
                seen[path.split("/")[0]] += 1
            for key in re.findall(r"\b([a-z_]+\.[a-z_0-9]+)=", line):
                assert key in keys, f"README's command sets {key}, which is no config key"
                seen["keys"] += 1
            for target in re.findall(r"^make (\S+)", line.strip()):
                assert target in targets, f"README runs make {target}, which the Makefile lacks"
                seen["make"] += 1
            for protocol in re.findall(r"--protocol (\S+)", line):
                assert (ROOT / "configs" / "eval" / f"{protocol}.yaml").exists(), protocol
    assert all(seen.values()), seen  # the check has something to check
    for module in re.findall(r"python -m (app\.[\w.]+)", README):
        assert (ROOT / (module.replace(".", "/") + ".py")).exists() or (ROOT / module.replace(".", "/")).is_dir()


def test_the_front_page_is_short():
    lines = README.splitlines()
    assert lines.index("## Two commands") <= 12  # the opening, the title included
    longest = max(prose_paragraphs(README), key=len)
    assert len(longest) <= 600, longest[:120]
    tests = README.split("## Tests", 1)[1].strip().split("\n## ")[0]
    assert len([line for line in tests.splitlines() if line.strip()]) <= 3


def test_the_tool_demos_range_is_the_runs_on_its_page():
    """README's range of the tool demo's held-out gains is the lowest and highest of the runs agents.md lists under
    the config's schedule (cosine to half)."""
    low, high = map(float, re.search(r"gains of \+(\d\.\d+) to \+(\d\.\d+)", README).groups())
    table = (ROOT / "docs" / "agents.md").read_text().split("| **cosine to half**")[1].split("| cosine to zero")[0]
    gains = [float(g) for g in re.findall(r"\*\*\+(\d\.\d+)\*\*", table)]
    assert len(gains) >= 5 and (min(gains), max(gains)) == (low, high)


def test_the_gpu_figures_are_the_reports():
    """The H200 ratios in README's results table are the default backend's rows of docs/gpu/report.md."""
    report = (ROOT / "docs" / "gpu" / "report.md").read_text()
    rows = [r for r in report.splitlines() if r.startswith("| Qwen2.5-VL-7B |") and "flex" in r]
    time8, mem8 = (float(c) for c in [c.strip() for c in rows[0].split("|")][5:8:2])
    time16, mem16 = (float(c) for c in [c.strip() for c in rows[1].split("|")][5:8:2])
    row = next(r for r in README.splitlines() if r.startswith("| one H200 | 4 of"))
    assert f"{round(time8, 2):.2f}x / {round(time16, 2):.2f}x time" in row
    assert f"{round(mem8, 2):.2f}x / {round(mem16, 2):.2f}x memory" in row
