"""Every relative link in README.md and docs/*.md leads to a file that exists and, where it
names an anchor (`file.md#section`), to a heading of that file (GitHub's anchor rules)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


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
