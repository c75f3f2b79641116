"""The README's training scripts, run as written: each ```python block whose first line names
its file (`# train.py`) is saved under that name and started with the `torchrun` command the
README gives for it, in a fresh directory; it must finish and its printed losses must fall."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import ROOT, subprocess_env

BLOCK = re.compile(r"```python\n# (?P<file>[\w.]+\.py)\n(?P<code>.*?)```", re.S)
COMMAND = re.compile(r"`(?P<command>torchrun [^`]*?(?P<file>[\w.]+\.py))`")
LOSS = re.compile(r"^step (\d+): loss ([\d.]+)$", re.M)


def _scripts() -> dict[str, tuple[str, str]]:
    """Each script's file name: (its code, the command the README runs it with)."""
    text = (ROOT / "README.md").read_text()
    commands = {m["file"]: m["command"] for m in COMMAND.finditer(text)}
    return {
        m["file"]: (f"# {m['file']}\n{m['code']}", commands.get(m["file"], ""))
        for m in BLOCK.finditer(text)
    }


def test_the_readme_has_training_scripts_with_their_commands():
    scripts = _scripts()
    assert {"train.py", "train_semi_auto.py"} <= set(scripts)
    for name, (_, command) in scripts.items():
        assert command.endswith(name), f"the README gives no torchrun command for {name}"


@pytest.mark.parametrize("name", sorted(_scripts()))
def test_a_readme_script_runs_as_written(name, tmp_path):
    code, command = _scripts()[name]
    (tmp_path / name).write_text(code)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    argv = [torchrun if word == "torchrun" else word for word in shlex.split(command)]
    done = subprocess.run(
        argv, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(loss) for _, loss in LOSS.findall(done.stdout)]
    assert len(losses) > 2, done.stdout
    assert losses[-1] < losses[0]
