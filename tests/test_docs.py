"""The users' README and the docs/ pages: README stays short, every relative link (and #anchor) resolves (also in
bench/README.md, where the measurements live), every docs page is reachable, and README keeps naming the CI test
command (`.ci/run` runs what README says)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 350  # 300 until the live-video client example (issue 33) joined it

# [text](target) and ![alt](target); a target ends at whitespace or ')' (no titles are used in these pages).
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def _pages() -> list[Path]:
    # bench/README.md holds the measurements the docs link to, and links back to them
    return [README, *sorted(DOCS.glob("*.md")), ROOT / "bench" / "README.md"]


def _outside_code(text: str) -> str:
    """The text with fenced code blocks and inline code spans blanked: links and headings there are not links."""
    kept, in_fence = [], False
    for line in text.split("\n"):
        if FENCE.match(line.lstrip()):
            in_fence = not in_fence
            kept.append("")
            continue
        kept.append("" if in_fence else re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped (letters, digits, '_', '-' and
    spaces kept), each space a '-'."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)  # a code span keeps its text
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every #anchor a page's headings give, with GitHub's -1, -2 ... suffixes for repeated headings."""
    seen: dict[str, int] = {}
    found = set()
    in_fence = False
    for line in page.read_text().split("\n"):
        if FENCE.match(line.lstrip()):
            in_fence = not in_fence
            continue
        heading = re.match(r"^#{1,6} +(.*?) *#*$", line)
        if in_fence or not heading:
            continue
        slug = github_slug(heading.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    return [
        target
        for target in LINK.findall(_outside_code(page.read_text()))
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto: ... are not checked here
    ]


def test_github_slug_follows_githubs_rules():
    assert github_slug("Quick start: few-step images") == "quick-start-few-step-images"
    assert (
        github_slug("Streamed chunks for API clients (`fewstep.chunk`)")
        == "streamed-chunks-for-api-clients-fewstepchunk"
    )
    assert (
        github_slug("Where the nodes' logic lives (engine, not nodes)")
        == "where-the-nodes-logic-lives-engine-not-nodes"
    )


def test_readme_is_at_most_350_lines():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; the users' page keeps to {README_MAX_LINES}"
    )


def test_readme_names_the_ci_test_command():
    # .ci/run runs the test command README gives for CI: dropping it from README would orphan CI's command.
    assert "make test-all" in README.read_text()


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(
                f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}"
            )
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def test_every_docs_page_is_reachable_from_readme_or_the_index():
    linked = set()
    for page in (README, DOCS / "index.md"):
        for target in relative_links(page):
            path_part = target.partition("#")[0]
            if path_part:
                linked.add((page.parent / path_part).resolve())
    orphans = [
        p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked and p.name != "index.md"
    ]
    assert (DOCS / "index.md").resolve() in linked, "README.md does not link docs/index.md"
    assert not orphans, f"docs pages linked from neither README.md nor docs/index.md: {orphans}"


def test_the_link_checker_sees_a_broken_link_and_a_broken_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Some `code` heading\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#some-code-heading) [no file](c.md) [no anchor](a.md#nope) `[in code](x.md)`\n"
        "```\n[in a fence](y.md)\n```\n"
    )
    assert relative_links(page) == ["a.md#some-code-heading", "c.md", "a.md#nope"]
    assert anchors(tmp_path / "a.md") == {"title", "some-code-heading"}


def _node_sections(text: str) -> dict[str, str]:
    """docs/nodes.md's '### `NodeId`' sections: node id -> the section's text."""
    parts = re.split(r"^### `([A-Za-z0-9_]+)`[^\n]*$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_nodes_page_documents_every_node_and_input():
    from fewstep.nodes import NODE_CLASS_MAPPINGS

    sections = _node_sections((DOCS / "nodes.md").read_text())
    missing = []
    for node_id, cls in NODE_CLASS_MAPPINGS.items():
        if node_id not in sections:
            missing.append(f"{node_id}: no '### `{node_id}`' section")
            continue
        inputs = cls.INPUT_TYPES()
        for name in [*inputs.get("required", {}), *inputs.get("optional", {})]:
            if f"`{name}`" not in sections[node_id]:
                missing.append(f"{node_id}: input '{name}' is not in its section")
    assert not missing, "docs/nodes.md is missing:\n" + "\n".join(missing)


def test_readme_live_client_example_is_the_tested_one():
    """README shows the client that tests/cli/test_live_client.py and tests/e2e/test_live_cli_e2e.py run (from
    docs/live-video.md): the two copies must not drift apart."""

    def block(text: str, heading: str) -> str:
        return text.split(heading, 1)[1].split("```python\n", 1)[1].split("\n```", 1)[0]

    live_doc = (README.parent / "docs" / "live-video.md").read_text()
    readme = README.read_text()
    assert block(readme, "## Live video: sessions clients steer while they run\n") == block(
        live_doc, "## A client in 50 lines\n"
    )
