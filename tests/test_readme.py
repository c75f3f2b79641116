"""Every code block of README.md runs as written, so the README cannot drift from the code.

The blocks run in the README's order in one workspace (a directory holding a copy of
`examples/`, as the repository's root does), each seeing what the blocks before it wrote:
- ```sh blocks command by command (`tessel` is this checkout's, `make demo` runs in the
  repository, `make test` is this suite and the one command not run here);
- ```python blocks as scripts: one whose first line names its file (`# train.py`) is saved
  under that name and started with the `torchrun` command the README gives for it, the others
  with `python`; a script that prints `step N: loss X` lines must show its loss falling;
- ```text blocks are pictures (the architecture) and are not run.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests.conftest import ROOT, subprocess_env

FENCE = re.compile(r"^```(?P<lang>\w*)\n(?P<code>.*?)^```$", re.S | re.M)
NAMED = re.compile(r"\A# (?P<file>[\w.]+\.py)\n")
TORCHRUN = re.compile(r"`(?P<command>torchrun [^`]*?(?P<file>[\w.]+\.py))`")
HEADING = re.compile(r"^## (.+)$", re.M)
LOSS = re.compile(r"^step (\d+): loss ([\d.]+)$", re.M)
NOT_RUN = {"make test": "the suite this test is part of"}
BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence in README.md
    lang: str
    code: str
    section: str  # the `## ` heading above it, and the block's number under it: `training-1`

    @property
    def file(self) -> str | None:
        named = NAMED.match(self.code)
        return named["file"] if named else None


def readme_blocks() -> list[Block]:
    text = (ROOT / "README.md").read_text()
    blocks, seen = [], Counter()
    for m in FENCE.finditer(text):
        headings = HEADING.findall(text, 0, m.start())
        title = re.sub(r"\W+", "-", headings[-1].lower()).strip("-") if headings else "top"
        seen[title] += 1
        line = text.count("\n", 0, m.start()) + 1
        blocks.append(Block(line, m["lang"], m["code"], f"{title}-{seen[title]}"))
    return blocks


def shell_commands(code: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and blanks dropped."""
    joined = code.replace("\\\n", " ")
    commands = [" ".join(shlex.split(line, comments=True)) for line in joined.splitlines()]
    return [c for c in commands if c]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("readme")
    shutil.copytree(ROOT / "examples", root / "examples")
    return root


def _run(argv: list[str], cwd: Path, where: str) -> str:
    done = subprocess.run(
        argv,
        cwd=cwd,
        # as in a shell whose virtual environment is active: `tessel` is this checkout's
        env=subprocess_env(PATH=os.pathsep.join([str(BIN), os.environ.get("PATH", "")])),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (
        f"{where}: {shlex.join(argv)} failed\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )
    return done.stdout


def test_every_block_is_one_the_test_runs_or_a_picture():
    blocks = readme_blocks()
    assert len(blocks) > 10
    for b in blocks:
        assert b.lang in ("sh", "python", "text"), f"README.md:{b.line}: a block of {b.lang!r}"
    assert [b.line for b in blocks if b.lang == "text"] == [
        b.line for b in blocks if "model (nn.Module" in b.code
    ], "only the architecture is a picture"
    commands = [c for b in blocks if b.lang == "sh" for c in shell_commands(b.code)]
    assert set(NOT_RUN) <= set(commands)
    torchrun = {m["file"] for m in TORCHRUN.finditer((ROOT / "README.md").read_text())}
    named = {b.file for b in blocks if b.file}
    assert named <= torchrun, f"no torchrun command in the README for {named - torchrun}"


@pytest.mark.parametrize(
    "block", [b for b in readme_blocks() if b.lang != "text"], ids=lambda b: b.section
)
def test_a_readme_block_runs_as_written(block, workspace):
    where = f"README.md:{block.line}"
    if block.lang == "sh":
        for command in shell_commands(block.code):
            if command in NOT_RUN:
                continue
            argv = shlex.split(command)
            if argv[0] == "make":
                _run(argv, ROOT, where)
                continue
            assert argv[0] == "tessel", f"{where}: {command}"
            _run([str(BIN / "tessel"), *argv[1:]], workspace, where)
        return
    name = block.file or f"readme_block_{block.line}.py"
    (workspace / name).write_text(block.code)
    if block.file:
        text = (ROOT / "README.md").read_text()
        command = next(m["command"] for m in TORCHRUN.finditer(text) if m["file"] == name)
        argv = [str(BIN / "torchrun") if w == "torchrun" else w for w in shlex.split(command)]
    else:
        argv = [sys.executable, name]
    out = _run(argv, workspace, where)
    losses = [float(loss) for _, loss in LOSS.findall(out)]
    if losses:
        assert len(losses) > 2 and losses[-1] < losses[0], out
