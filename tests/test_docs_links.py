"""Every relative link in README.md and docs/ (the study pages too) leads to a file that exists
and, where it names an anchor (`file.md#section`), to a heading of that file (GitHub's anchor
rules); every figure a page shows exists; every transcribed result (docs/results/*.json) names a
page and section that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown file: lower case, punctuation other than
    `-` and `_` dropped, spaces to `-`; a repeated heading gets `-1`, `-2`, ..."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for target in LINK.findall(_prose(doc.read_text())):
            if not re.match(r"[a-z]+:", target):  # http:, https:, mailto: are not checked here
                found.append((str(doc.relative_to(ROOT)), target))
    return found


LINKS = links()
IMAGES = [(str(doc.relative_to(ROOT)), target) for doc in DOCS for target in IMAGE.findall(_prose(doc.read_text()))]


def transcribed_sources() -> list[tuple[str, str]]:
    """(results file, `docs/page.md#section`) for every record of docs/results/*.json that names its source."""
    out = []
    for path in sorted((ROOT / "docs" / "results").glob("*.json")):
        data = json.loads(path.read_text())
        for record in [*data.get("results", []), *data.get("prices", [])]:
            for text in (record.get("source"), record.get("note")):
                out += [(path.name, m) for m in re.findall(r"docs/[\w./-]+\.md(?:#[\w-]+)?", text or "")]
    return sorted(set(out))


SOURCES = transcribed_sources()


def test_the_docs_have_links():
    assert len(LINKS) > 20, "the extraction found too few links"


def test_anchor_rules_by_hand(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Title\n## The memory's learning rate\n## Sorting at CPU scale (`benchmarks/sorting.py`)\n"
                    "## Notes\n## Notes\n```\n# not a heading\n```\n")
    assert anchors(page) == {"title", "the-memorys-learning-rate", "sorting-at-cpu-scale-benchmarkssortingpy",
                             "notes", "notes-1"}


@pytest.mark.parametrize("doc,target", LINKS, ids=[f"{d}:{t}" for d, t in LINKS])
def test_relative_link_resolves(doc, target):
    path, _, anchor = target.partition("#")
    file = (ROOT / doc).parent / path if path else ROOT / doc
    assert file.exists(), f"{doc}: link to {target}: no such file {file.relative_to(ROOT)}"
    if anchor:
        assert file.suffix == ".md", f"{doc}: link to {target}: an anchor into a file that is not markdown"
        assert anchor in anchors(file), f"{doc}: link to {target}: {file.name} has no heading with that anchor"


def test_the_docs_show_figures_and_the_results_name_their_sources():
    assert any(t.endswith("compare.png") for _, t in IMAGES), "README or results.md lost the comparison figure"
    assert len(SOURCES) > 10


@pytest.mark.parametrize("doc,target", IMAGES, ids=[f"{d}:{t}" for d, t in IMAGES])
def test_every_figure_exists(doc, target):
    assert ((ROOT / doc).parent / target).is_file(), f"{doc}: figure {target} does not exist"


@pytest.mark.parametrize("results,source", SOURCES, ids=[f"{r}:{s}" for r, s in SOURCES])
def test_every_transcribed_result_names_a_section_that_exists(results, source):
    path, _, anchor = source.partition("#")
    assert (ROOT / path).is_file(), f"docs/results/{results}: source {source}: no such page"
    if anchor:
        assert anchor in anchors(ROOT / path), f"docs/results/{results}: source {source}: no such section"


def test_the_results_page_reads_in_a_minute_and_the_studies_stay_short():
    """results.md is the current picture (issue 50): at most 300 lines; each study at most 500."""
    assert len((ROOT / "docs" / "results.md").read_text().splitlines()) <= 300
    studies = sorted((ROOT / "docs" / "studies").glob("*.md"))
    assert studies and all(len(p.read_text().splitlines()) <= 500 for p in studies)
    linked = {t.split("#")[0] for d, t in LINKS if d == "docs/results.md"}
    assert {f"studies/{p.name}" for p in studies} <= linked, "results.md links every study"
