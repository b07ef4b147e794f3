"""The documentation: README length and commands, relative links, a command and date for every figure,
and notebooks stored executed.

Fast and TensorFlow-free: it only reads README.md, docs/*.md and notebooks/*.ipynb.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_LINES = 210

# [text](target) or [text](target "title"); images ![alt](target) too. Not inside inline code.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
TABLE_ROW = re.compile(r"^\s*\|.*\|\s*$")
HEADING = re.compile(r"^(#{1,6})\s")


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def without_code(text: str) -> str:
    """The text with fenced code blocks and inline code spans blanked (line numbers kept)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            lines.append("")
            continue
        lines.append("" if fenced else re.sub(r"`[^`]*`", "``", line))
    return "\n".join(lines)


def relative_links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(without_code(path.read_text(encoding="utf-8")).splitlines(), 1):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:, ...
                continue
            found.append((number, target))
    return found


def sections(text: str) -> list[tuple[str, list[str]]]:
    """(heading, lines) for every ## or ### section; a ### section is not part of the ## above it."""
    result: list[tuple[str, list[str]]] = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        match = None if fenced else HEADING.match(line)
        if match and len(match.group(1)) in (2, 3):
            result.append((line.strip(), []))
        elif match and len(match.group(1)) == 1:
            result.append(("", []))  # text under the title belongs to no figure section
        elif result:
            result[-1][1].append(line)
    return result


def test_docs_exist():
    assert DOCS.is_dir(), "docs/ is missing"
    for name in ("README.md", "benchmarks.md", "design.md"):
        assert (DOCS / name).is_file(), f"docs/{name} is missing"


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines (at most {MAX_README_LINES}); move details to docs/")


def test_readme_gives_the_two_commands():
    text = README.read_text(encoding="utf-8")
    assert "make demo" in text and "make test" in text


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_to_existing_files(path):
    broken = []
    for number, target in relative_links(path):
        file_part = target.split("#", 1)[0].split("?", 1)[0]
        if not file_part:  # "#anchor" within the same page
            continue
        if not (path.parent / file_part).exists():
            broken.append(f"{path.relative_to(REPO)}:{number}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_every_figure_section_in_benchmarks_has_a_command_and_a_date():
    text = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    figure_sections = [(heading, body) for heading, body in sections(text)
                       if heading and any(TABLE_ROW.match(line) for line in body)]
    assert figure_sections, "docs/benchmarks.md has no section with a table"
    missing = []
    for heading, body in figure_sections:
        if not any(DATE.search(line) for line in body):
            missing.append(f"{heading}: no date (YYYY-MM-DD)")
        if not any("tfdist bench" in line or re.search(r"\bmake\b", line) for line in body):
            missing.append(f"{heading}: no command (a line with `tfdist bench` or `make`)")
    assert not missing, "docs/benchmarks.md:\n" + "\n".join(missing)


def test_the_checks_themselves():
    # The link pattern and the section splitter, on a small sample, so a silent regex slip cannot
    # make the tests above pass vacuously.
    sample = "# T\n## A\n| x |\n|---|\n`tfdist bench a` 2026-01-01\n### B\ntext [l](docs/x.md#y) `[c](no.md)`\n"
    (a, a_body), (b, b_body) = sections(sample)[1:]
    assert a == "## A" and any(TABLE_ROW.match(line) for line in a_body) and b == "### B"
    assert LINK.findall(without_code(b_body[0])) == ["docs/x.md#y"]
    assert LINK.findall("[site](https://example.org) ![img](a.png)") == ["https://example.org", "a.png"]


@pytest.mark.parametrize("notebook", sorted((REPO / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_notebooks_are_stored_executed_with_their_plots(notebook):
    """Notebooks read on the repository's web page: every code cell ran (in order) and the plots are there.
    CI executes them again (pytest --nbmake)."""
    import json

    cells = [c for c in json.loads(notebook.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code"]
    counts = [c.get("execution_count") for c in cells]
    assert all(isinstance(n, int) for n in counts), f"{notebook.name}: cells not executed: {counts}"
    assert counts == sorted(counts), f"{notebook.name}: cells stored out of order: {counts}"
    images = [o for c in cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, f"{notebook.name}: no plot stored"


# Names a notebook must not teach: internals (a private module or name) and names that moved.
NOTEBOOK_BANNED = [
    (re.compile(r"\bfrom tfdist(\.\w+)*\s+import\s+.*\b_\w+"), "a private name"),
    (re.compile(r"\btfdist(\.\w+)*\._\w+"), "a private module"),
    (re.compile(r"\btfdist\.bench\b|\bbenchmarks\.\w+|\bfrom benchmarks\b"), "the benchmarks' internals"),
    (re.compile(r"\btfdist\.cluster\.launcher\b|\btfdist\.cluster\.(BackupAndRestore|ModelCheckpoint|Preemption)\b"),
     "a legacy name (tfdist.training has the callbacks; `tfdist launch` starts processes)"),
]


@pytest.mark.parametrize("notebook", sorted((REPO / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_notebooks_store_no_log_noise_and_use_public_names(notebook):
    import json

    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    problems = []
    for number, cell in enumerate(cells):
        source = "".join(cell["source"])
        if cell["cell_type"] == "code":
            for pattern, what in NOTEBOOK_BANNED:
                for match in pattern.finditer(source):
                    problems.append(f"cell {number}: {match.group(0)!r} is {what}")
        for output in cell.get("outputs", []):
            if output.get("name") == "stderr":
                problems.append(f"cell {number}: stored stderr: {''.join(output.get('text', ''))[:120]!r}")
            text = "".join(output.get("text", ""))
            if re.search(r"^[IWE]\d{4} \d\d:\d\d:\d\d|InitializeLog|Warning:|^(INFO|WARNING):tensorflow:", text, re.M):
                problems.append(f"cell {number}: log line in an output: {text[:120]!r}")
    assert not problems, f"{notebook.name}:\n" + "\n".join(problems)
