"""Every `docs/<page>.md, "<Section>"` pointer in the project (docs, README, SECURITY.md, the
chart's values, templates and alerts, the code) names the start of a section of that page (a
heading, or a paragraph's bold lead-in): a user who follows one from an alert or a values
comment must find what it promises."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
POINTER = re.compile(r'docs/([a-z-]+)\.md,? "([^"]+)"')
SKIPPED = ("benchmarks/results/",)


def tracked_texts() -> dict[str, str]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    texts = {}
    for name in names:
        if name.startswith(SKIPPED) or not name.endswith((".md", ".py", ".yaml", ".txt", ".tpl")):
            continue
        # A pointer may wrap inside a comment or a docstring: join the lines, comment marks
        # and indentation dropped.
        lines = (re.sub(r"^\s*(#+\s?)?", "", line)
                 for line in (REPO / name).read_text().splitlines())
        text = " ".join(lines)
        if name.endswith(".py"):  # a message's pieces, implicitly concatenated, unescaped
            text = re.sub(r'"\s+f?"', "", text).replace('\\"', '"')
        texts[name] = text
    return texts


def section_starts(page: str) -> list[str]:
    """The headings of the page, and the paragraphs that open with a bold lead-in or a line
    ending in a colon (`**Rendering without a cluster** (...)`, `How the name is protected:`),
    without their markup: a pointer names the start of one."""
    starts = []
    for line in (REPO / "docs" / f"{page}.md").read_text().splitlines():
        if line.startswith("#"):
            starts.append(line.lstrip("#").strip())
        elif line.startswith("**") or line.rstrip().endswith(":"):
            starts.append(line.strip())
    return [re.sub(r"[`*]", "", start) for start in starts]


def test_every_docs_section_pointer_names_a_heading_of_its_page() -> None:
    found, broken = 0, []
    for name, text in tracked_texts().items():
        for page, section in POINTER.findall(text):
            found += 1
            if not (REPO / "docs" / f"{page}.md").exists():
                broken.append(f"{name}: docs/{page}.md does not exist")
            elif not any(start.startswith(section.replace("`", ""))
                         for start in section_starts(page)):
                broken.append(f'{name}: docs/{page}.md has no section "{section}"')
    assert found > 20  # the pattern still finds the pointers
    assert not broken, "\n".join(broken)
