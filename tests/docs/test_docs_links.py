"""Every relative link and #anchor in README.md and docs/*.md resolves (GitHub's heading anchors)."""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target); the target stops at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def pages(root: Path = REPO_ROOT) -> list[Path]:
    """The pages checked: README.md, every docs/*.md (the guides) and docs/results/*.md (the reports)."""
    return [
        root / "README.md",
        *sorted((root / "docs").glob("*.md")),
        *sorted((root / "docs" / "results").glob("*.md")),
    ]


def _prose(text: str) -> str:
    """The page without fenced code blocks and inline code, where brackets are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lower-cased, punctuation dropped, spaces -> hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives `page`'s headings (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        slug = github_slug(heading)
        count = seen.get(slug, 0)
        found.add(slug if count == 0 else f"{slug}-{count}")
        seen[slug] = count + 1
    return found


def broken_links(page: Path) -> list[str]:
    """`page`'s relative links whose file or #anchor does not exist, as 'target: why'."""
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    return broken


def test_every_link_in_readme_and_docs_resolves() -> None:
    checked = pages()
    assert len(checked) > 5, checked
    broken = {str(p.relative_to(REPO_ROOT)): b for p in checked if (b := broken_links(p))}
    assert not broken, broken


def test_a_broken_link_or_anchor_is_reported(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "topic.md").write_text("# Topic\n\n## The GPU split (`configs/`)\n\ntext\n")
    (tmp_path / "README.md").write_text(
        "# Front\n\n## Same\n\n## Same\n\n"
        "[ok](docs/topic.md) [ok](docs/topic.md#the-gpu-split-configs) [ok](#same-1) [web](https://x.org/#nope)\n"
        "[gone](docs/missing.md) [bad anchor](docs/topic.md#the-split) [bad local](#same-2)\n"
        "`[in code](docs/missing2.md)`\n\n```\n[in a fence](docs/missing3.md)\n```\n"
    )
    found = broken_links(tmp_path / "README.md")
    assert [b.split(":")[0] for b in found] == ["docs/missing.md", "docs/topic.md#the-split", "#same-2"], found
    assert broken_links(tmp_path / "docs" / "topic.md") == []


def test_github_slug_rules() -> None:
    assert github_slug("One GPU: every role on GPU 0") == "one-gpu-every-role-on-gpu-0"
    assert github_slug("Presets (`configs/presets/`)") == "presets-configspresets"
    assert github_slug("The paper's comparison: on-policy against supervised KD") == (
        "the-papers-comparison-on-policy-against-supervised-kd"
    )
    assert github_slug("weight_sync") == "weight_sync"


# What a user page must not carry: the project's own bookkeeping (issue numbers, commit ids) or one
# machine's word ("this machine"); a measurement says what kind of machine it ran on instead.
BOOKKEEPING = re.compile(r"\b[Ii]ssues? #?\d+\b|\bcommit [0-9a-f]{7,40}\b|\bthis machine\b")


def test_no_issue_numbers_commit_ids_or_this_machine_in_user_pages() -> None:
    found = {str(p.relative_to(REPO_ROOT)): BOOKKEEPING.findall(_prose(p.read_text())) for p in pages()}
    found = {k: v for k, v in found.items() if v}
    assert not found, found


def test_every_page_is_linked_and_every_report_from_a_guide() -> None:
    """README links the guides (docs/*.md), the guides link the reports (docs/results/*.md): nothing is orphaned."""
    linked: dict[Path, set[Path]] = {}
    for page in pages():
        for target in LINK.findall(_prose(page.read_text())):
            path_part = target.partition("#")[0]
            if path_part and not re.match(r"^[a-z][a-z0-9+.-]*:", target):
                linked.setdefault((page.parent / path_part).resolve(), set()).add(page)
    guides = sorted((REPO_ROOT / "docs").glob("*.md"))
    reports = sorted((REPO_ROOT / "docs" / "results").glob("*.md"))
    orphans = [str(p.relative_to(REPO_ROOT)) for p in [*guides, *reports] if not linked.get(p.resolve())]
    assert not orphans, f"pages no page links: {orphans}"
    unguided = [
        str(p.relative_to(REPO_ROOT))
        for p in reports
        if not any(src.parent == REPO_ROOT / "docs" for src in linked.get(p.resolve(), set()))
    ]
    assert not unguided, f"reports no guide links: {unguided}"
