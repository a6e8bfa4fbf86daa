"""Every relative link in README.md and docs/*.md resolves, and every #anchor names a heading of
its target (GitHub's slugs), so the docs cannot rot silently when a page or heading moves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{page.name}: {target} (no such heading)")
    return bad


def test_every_doc_link_resolves() -> None:
    assert len(PAGES) >= 7
    assert [b for p in PAGES for b in broken_links(p)] == []


def test_the_checker_sees_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Top `x` (y)\n\n[ok](#top-x-y) [gone](b.md) [bad](#nope)\n")
    assert broken_links(tmp_path / "a.md") == [
        "a.md: b.md (no such file)",
        "a.md: #nope (no such heading)",
    ]
    assert (
        slug("API summary (contract: [`docs/api.md`](docs/api.md); x)")
        == "api-summary-contract-docsapimd-x"
    )


def test_the_readme_is_short_and_nothing_points_outside_the_repo() -> None:
    assert (
        len((ROOT / "README.md").read_text().splitlines()) <= 130
    )  # a front door: a screen a question
    for page in PAGES:
        assert "shared/" not in page.read_text(), page
