"""The fenced code of README.md and docs/*.md, as the docs tests run it.

A page's Python blocks run in order in one namespace, as a notebook's cells do: a later block may use what an
earlier one defined. Pages run one after another in a process shared by the pages that start TensorFlow with the
same logical CPUs (test_doc_blocks.py), each in a fresh namespace and working directory. A block whose first line
says `run with: tfdist launch ... -- python train.py` is a script of its own: it is written to train.py and started
with that command. A block preceded by the line `<!-- not run: REASON -->` is skipped (the reason is required).

To stay inside the suite's budget the runner shortens each `fit` (`for_the_suite`): one epoch, and on a dataset a
few steps unless the block sets `steps_per_epoch`. Nothing else in a block is changed.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->\s*$")
RUN_WITH = re.compile(r"run with:\s*(tfdist launch .*?-- python train\.py)")
EPOCHS = re.compile(r"\bepochs=\d+")


@dataclass
class Block:
    page: str           # path relative to the repository
    line: int           # line of the opening fence
    language: str
    code: str
    launch: list[str] | None = None   # the command that runs it as train.py
    not_run: str | None = None        # why it is not run

    @property
    def label(self) -> str:
        return f"{self.page}:{self.line}"


def markdown_pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def blocks(path: Path) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skipped = NOT_RUN.search(before)
        code = match.group(2)
        first = code.splitlines()[0] if code.strip() else ""
        run_with = RUN_WITH.search(first)
        found.append(Block(str(path.relative_to(REPO)), line, match.group(1), code,
                           shlex.split(run_with.group(1)) if run_with else None,
                           skipped.group(1) if skipped else None))
    return found


def python_blocks() -> list[Block]:
    return [b for page in markdown_pages() for b in blocks(page) if b.language == "python"]


# A `fit` in the suite: one epoch of at most this many steps (and validation steps); the block's own choice is kept
# where it makes one. The blocks train on the real MNIST: whole epochs would be most of the suite's time in them.
SUITE_STEPS, SUITE_VALIDATION_STEPS = 24, 4


def for_the_suite(code: str) -> str:
    """The block as the suite runs it: each `fit` one epoch, of SUITE_STEPS steps where it gives no
    `steps_per_epoch` and trains on a dataset (arrays keep their few batches), and SUITE_VALIDATION_STEPS
    validation steps when it validates."""
    out, at = [], 0
    for call in re.finditer(r"\.fit\(", code):
        if call.start() < at:
            continue
        end = _closing_paren(code, call.end())
        args = EPOCHS.sub("epochs=1", code[call.end():end])
        if "epochs=" in args and "steps_per_epoch" not in args and "batch_size" not in args:  # not on arrays
            args = args.replace("epochs=1", f"epochs=1, steps_per_epoch={SUITE_STEPS}", 1)
        if "validation_data" in args and "validation_steps" not in args:
            args = args.replace("epochs=1", f"epochs=1, validation_steps={SUITE_VALIDATION_STEPS}", 1)
        out += [code[at:call.end()], args]
        at = end
    return "".join(out) + code[at:]


def _closing_paren(code: str, start: int) -> int:
    """The index of the ")" that closes the call whose arguments begin at `start`."""
    depth = 1
    for i in range(start, len(code)):
        depth += {"(": 1, ")": -1}.get(code[i], 0)
        if depth == 0:
            return i
    raise ValueError(f"unbalanced parentheses in a fit call: {code[start - 5:start + 60]!r}")


def tfdist_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) for every `tfdist ...` line of the shell blocks, and the tfdist command a launch starts."""
    found = []
    for page in markdown_pages():
        for block in blocks(page):
            if block.language not in ("bash", "sh", "console"):
                continue
            for offset, raw in enumerate(block.code.splitlines(), 1):
                line = raw.split("#", 1)[0].strip()
                line = re.sub(r"^(\w+=\S+\s+)+", "", line)  # VAR=value prefixes
                if not line.startswith("tfdist ") or "..." in line:
                    continue
                argv = shlex.split(line)[1:]
                found.append((f"{block.page}:{block.line + offset}", argv))
                if "--" in argv and argv[0] == "launch":
                    inner = argv[argv.index("--") + 1:]
                    if inner[:1] == ["tfdist"]:
                        found.append((f"{block.page}:{block.line + offset} (launched)", inner[1:]))
    return found
