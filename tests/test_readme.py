"""Every code block of README.md and of the documentation site runs as written, so neither can
drift from the code.

The site's pages run in the order of `nav` in mkdocs.yml, in one workspace (a directory holding a
copy of `examples/`, as the repository's root does), each block seeing what the blocks before it
wrote, on its own page and on earlier pages (a page that uses an earlier page's files says so):
- ```sh blocks command by command (`tessel` is this checkout's, `make demo` runs in the
  repository, `make test` is this suite and the one command not run here); `tessel serve` runs
  in the background for the rest of its section: the test waits until its `/health` answers
  200, runs the section's next blocks (its clients), then stops it with SIGTERM, and it must
  exit 0 (the section is one test, named by its first and last block: every test leaves no
  process behind);
- ```python blocks as scripts: one whose first line names its file (`# train.py`) is saved
  under that name and started with the `torchrun` command its page gives for it, the others
  with `python`; a script that prints `step N: loss X` lines must show its loss falling;
- ```text blocks are pictures (the architecture) and are not run.

README.md's blocks are Getting started's, the same code in the same order (a test checks it), and
Getting started is the first page with blocks: running that page in the fresh workspace runs the
README's blocks as written, in the README's order, so they are not run a second time.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from tests.conftest import ROOT, subprocess_env

FENCE = re.compile(r"^```(?P<lang>\w*)\n(?P<code>.*?)^```$", re.S | re.M)
NAMED = re.compile(r"\A# (?P<file>[\w.]+\.py)\n")
TORCHRUN = re.compile(r"`(?P<command>torchrun [^`]*?(?P<file>[\w.]+\.py))`")
HEADING = re.compile(r"^#{1,3} (.+)$", re.M)
LOSS = re.compile(r"^step (\d+): loss ([\d.]+)$", re.M)
NOT_RUN = {"make test": "the suite this test is part of"}
BIN = Path(sys.executable).parent
README = "README.md"
GETTING_STARTED = "docs/getting-started.md"
README_LINES = 150


@dataclass(frozen=True)
class Block:
    doc: str  # README.md, or a page: docs/guides/serving.md
    line: int  # of the opening fence in the document
    lang: str
    code: str
    section: str  # the heading above it, and the block's number under it: `train-1`

    @property
    def file(self) -> str | None:
        named = NAMED.match(self.code)
        return named["file"] if named else None

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.section}"


@dataclass(frozen=True)
class Served:
    """A block that starts `tessel serve`, and the blocks after it in its section."""

    blocks: tuple[Block, ...]

    @property
    def id(self) -> str:
        return f"{self.blocks[0].id}..{self.blocks[-1].section}"


def site_pages() -> list[str]:
    """The site's pages in the order of mkdocs.yml's nav, as paths from the repository's root."""

    def walk(entry: object) -> list[str]:
        if isinstance(entry, str):
            return [entry]
        if isinstance(entry, list):
            return [page for item in entry for page in walk(item)]
        assert isinstance(entry, dict), entry
        return [page for value in entry.values() for page in walk(value)]

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    return [f"docs/{page}" for page in walk(nav)]


def blocks_of(doc: str) -> list[Block]:
    text = (ROOT / doc).read_text()
    # the headings of the prose: each block blanked (a `# train.py` line is no heading)
    prose = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m[0]), text)
    blocks, seen = [], Counter()
    for m in FENCE.finditer(text):
        headings = HEADING.findall(prose, 0, m.start())
        title = re.sub(r"\W+", "-", headings[-1].lower()).strip("-") if headings else "top"
        seen[title] += 1
        line = text.count("\n", 0, m.start()) + 1
        blocks.append(Block(doc, line, m["lang"], m["code"], f"{title}-{seen[title]}"))
    return blocks


def shell_commands(code: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and blanks dropped."""
    joined = code.replace("\\\n", " ")
    commands = [" ".join(shlex.split(line, comments=True)) for line in joined.splitlines()]
    return [c for c in commands if c]


def serves(block: Block) -> bool:
    return block.lang == "sh" and any(
        c.startswith("tessel serve ") for c in shell_commands(block.code)
    )


def title(block: Block) -> str:
    return block.section.rpartition("-")[0]


def steps() -> list[Block | Served]:
    """Every block of the site that runs, in the order of nav; a block that starts a server
    runs with the rest of its section."""
    out: list[Block | Served] = []
    for page in site_pages():
        blocks = [b for b in blocks_of(page) if b.lang != "text"]
        while blocks:
            block = blocks.pop(0)
            if not serves(block):
                out.append(block)
                continue
            section = [block]
            while blocks and title(blocks[0]) == title(block):
                section.append(blocks.pop(0))
            out.append(Served(tuple(section)))
    return out


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("site")
    shutil.copytree(ROOT / "examples", root / "examples")
    return root


def _env() -> dict[str, str]:
    # as in a shell whose virtual environment is active: `tessel` is this checkout's
    return subprocess_env(PATH=os.pathsep.join([str(BIN), os.environ.get("PATH", "")]))


def _run(argv: list[str], cwd: Path, where: str) -> str:
    done = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (
        f"{where}: {shlex.join(argv)} failed\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )
    return done.stdout


def _serve(argv: list[str], root: Path, block: Block, servers: list) -> None:
    """`tessel serve` in the background, until its /health answers 200."""
    assert "--port" in argv, f"{block.where}: a served example names its port"
    port = int(argv[argv.index("--port") + 1])
    log = root / f"serve_{block.line}.log"
    with log.open("w") as sink:
        server = subprocess.Popen(argv, cwd=root, env=_env(), stdout=sink, stderr=subprocess.STDOUT)
    servers.append((server, log))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert server.poll() is None, f"{block.where}: tessel serve exited\n{log.read_text()}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"{block.where}: tessel serve not ready in 300 s\n{log.read_text()[-4000:]}")


def test_the_readme_is_short():
    lines = (ROOT / README).read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines, at most {README_LINES}"


def test_the_readme_blocks_are_getting_started_and_run_there_first():
    """The README's blocks are Getting started's, in the same order, and Getting started is the
    first page with blocks: running the site from its first page runs the README as written."""
    readme = [(b.lang, b.code) for b in blocks_of(README)]
    page = [(b.lang, b.code) for b in blocks_of(GETTING_STARTED)]
    assert readme == page, "README.md's blocks differ from docs/getting-started.md's"
    with_blocks = [p for p in site_pages() if blocks_of(p)]
    assert with_blocks[0] == GETTING_STARTED, with_blocks


def test_every_page_is_in_the_nav_once():
    pages = site_pages()
    assert len(pages) == len(set(pages)), pages
    on_disk = {str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk == set(pages), on_disk ^ set(pages)


@pytest.mark.parametrize("doc", [README, *site_pages()])
def test_every_block_is_one_the_test_runs_or_a_picture(doc):
    blocks = blocks_of(doc)
    for b in blocks:
        assert b.lang in ("sh", "python", "text"), f"{b.where}: a block of {b.lang!r}"
        if b.lang == "text":
            assert "model (nn.Module" in b.code, f"{b.where}: only the architecture is a picture"
    torchrun = {m["file"] for m in TORCHRUN.finditer((ROOT / doc).read_text())}
    named = {b.file for b in blocks if b.file}
    assert named <= torchrun, f"no torchrun command in {doc} for {named - torchrun}"


def test_the_site_has_the_blocks_the_test_expects():
    blocks = [b for p in [README, *site_pages()] for b in blocks_of(p)]
    assert len(blocks) > 20
    assert sum(b.lang == "text" for b in blocks) == 1, "the architecture, once"
    commands = [c for b in blocks if b.lang == "sh" for c in shell_commands(b.code)]
    assert set(NOT_RUN) <= set(commands)
    assert any(serves(b) for b in blocks_of(README))


@pytest.mark.parametrize("step", steps(), ids=lambda s: s.id)
def test_a_block_runs_as_written(step, workspace):
    if isinstance(step, Block):
        _run_block(step, workspace, [])
        return
    servers: list[tuple[subprocess.Popen, Path]] = []
    try:
        for block in step.blocks:
            _run_block(block, workspace, servers)
    finally:
        for server, log in servers:
            server.terminate()  # SIGTERM: stop admitting, finish what runs, exit 0
            try:
                code = server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                code = server.wait()
            assert code == 0, f"{step.id}: tessel serve exited {code}\n{log.read_text()[-4000:]}"


def _run_block(block: Block, root: Path, servers: list) -> None:
    where = block.where
    if block.lang == "sh":
        for command in shell_commands(block.code):
            if command in NOT_RUN:
                continue
            argv = shlex.split(command)
            if argv[0] == "make":
                _run(argv, ROOT, where)
                continue
            assert argv[0] == "tessel", f"{where}: {command}"
            argv = [str(BIN / "tessel"), *argv[1:]]
            if argv[1] == "serve":
                _serve(argv, root, block, servers)
            else:
                _run(argv, root, where)
        return
    name = block.file or f"block_{Path(block.doc).stem}_{block.line}.py"
    (root / name).write_text(block.code)
    if block.file:
        text = (ROOT / block.doc).read_text()
        command = next(m["command"] for m in TORCHRUN.finditer(text) if m["file"] == name)
        argv = [str(BIN / "torchrun") if w == "torchrun" else w for w in shlex.split(command)]
    else:
        argv = [sys.executable, name]
    out = _run(argv, root, where)
    losses = [float(loss) for _, loss in LOSS.findall(out)]
    if losses:
        assert len(losses) > 2 and losses[-1] < losses[0], out
