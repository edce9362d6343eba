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
    """The pages checked: README.md and every docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


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
