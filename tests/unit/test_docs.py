"""The README and the pages under docs/ stay readable and their links lead somewhere."""

import json
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"
PAGES = [README, *sorted((REPO_ROOT / "docs").glob("*.md")), REPO_ROOT / "benchmarks" / "NOTES.md"]
README_MAX_LINES = 300


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_every_relative_link_leads_to_a_file_and_heading_that_exist():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
                broken.append(f"{page.relative_to(REPO_ROOT)}: {target}")
    assert broken == []


def test_the_readme_is_short_and_names_no_commit_outside_a_cited_result():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES
    for line in lines:
        for word in re.findall(r"\b[0-9a-f]{7,40}\b", line):
            if re.search(r"\d", word) and re.search(r"[a-f]", word):  # a hash, not a number or a word
                assert f"_{word}" in line, f"README names commit {word} outside a result it cites: {line}"


def test_the_readme_figures_are_those_of_the_results_they_cite():
    """A README line citing a result JSON states that JSON's tokens/s and MFU (as RESULTS.md rounds them)."""
    cited = 0
    for line in README.read_text().splitlines():
        for name in re.findall(r"\(benchmarks/results/([\w.]+\.json)\)", line):
            result = json.loads((REPO_ROOT / "benchmarks" / "results" / name).read_text())
            assert f"{result['tokens_per_sec_per_gpu'] / 1e3:.1f}k" in line, line
            assert f"{result['mfu_pct']:.1f}%" in line, line
            cited += 1
    assert cited > 0
