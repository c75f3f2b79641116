"""A conversion killed (SIGKILL) at any moment leaves the old output or the new one, never a mix.

Conversion processes (each running what ``tessel ckpt ...`` runs, or calling the API) are started
over a destination that holds an older complete output. The test hook ``TESSEL_TEST_PAUSE_AT``
makes each stop at a named point and create a marker file; the test waits for the marker (an
event, no sleeps to guess timing), kills the process with SIGKILL, checks the destination file by
file against the old and the new output, then runs the conversion again and checks that it
succeeds and clears what the killed run left behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

import tessel
from tessel.checkpoint.publish import PAUSE_ENV, PAUSE_MARKER_ENV, StagedTree
from tessel.checkpoint.strategy import load_strategy
from tessel.parallel import (
    Layout,
    convert_checkpoint_by_rank,
    convert_checkpoints,
    save_strategy_file,
    shard_checkpoint,
    unified_safetensors,
)

from .helpers import files_bytes, make_full, ref_rank_slices, write_full

SHAPES = {"emb": (16, 8), "qkv": (24, 8), "out": (8, 24), "norm": (8,)}
SRC_DIR = str(Path(tessel.__file__).resolve().parents[1])  # the tessel this test imports
# Starts one conversion process per line of JSON on stdin and prints its pid; at end of input
# prints "pid exit-status" for each. Each process is forked from this one after torch and tessel
# are imported, so a dozen of them start in well under a second instead of seconds apiece; each
# then runs exactly what `tessel ckpt ...` runs (tessel.cli.main) or calls the API.
LAUNCHER = """
import json, os, sys, traceback
from tessel.cli import main
from tessel.checkpoint import publish
from tessel.parallel import convert_checkpoint_by_rank
import tessel.builder.options, tessel.checkpoint.cli, tqdm  # what main() imports

def run(spec):
    fd = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(spec["env"])
    if spec["no_exchange"]:  # as on a file system that cannot exchange two directories
        publish.exchange = lambda a, b: False
    if spec["by_rank"]:
        rank, files, save, src, dst = spec["by_rank"]
        convert_checkpoint_by_rank(rank, {int(r): f for r, f in files.items()}, save, src, dst)
        return 0
    return main(spec["argv"])

pids = []
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        try:
            code = run(json.loads(line))
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    pids.append(pid)
    print(pid, flush=True)
for pid in pids:
    print(pid, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


def _strategy(path: Path, dp: int, tp: int) -> Path:
    lay = Layout((dp, tp), ("dp", "tp"))
    save_strategy_file(path, {
        "emb": (lay("tp", "None"), SHAPES["emb"], "float32"),
        "qkv": (lay("tp", "None"), SHAPES["qkv"], "float32"),
        "out": (lay("None", "tp"), SHAPES["out"], "float32"),
        "norm": (lay("None"), SHAPES["norm"], "float32"),
    })  # fmt: skip
    return path


def _snapshot(d: Path) -> dict[str, str] | None:
    """SHA-256 of every file under ``d`` by relative path, hidden ones left out; None if ``d``
    does not exist."""
    if not d.exists():
        return None
    files = files_bytes(d)
    return {k: hashlib.sha256(v).hexdigest() for k, v in files.items() if not k.startswith(".")}


def _hidden(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


@dataclass
class World:
    """Sources, strategies and the old/new outputs every case compares against."""

    root: Path
    new_src: Path  # tp4 checkpoint of the new weights
    old_src: Path  # tp4 checkpoint of other (older) weights
    tp4: Path
    tp2: Path
    dp2tp2: Path
    full: dict[str, torch.Tensor]
    old: dict[str, Path] = field(default_factory=dict)  # kind -> pristine old output
    new: dict[str, dict | None] = field(default_factory=dict)  # kind -> snapshot of new output


def _convert(w: World, src: Path, dst: Path) -> None:
    convert_checkpoints(src, dst, "checkpoint_", w.tp4, w.dp2tp2)


def _unify(w: World, src: Path, dst: Path, size: int = 600) -> None:
    unified_safetensors(src, w.tp4, dst, max_shard_size=size)


def _by_rank(w: World, src: Path, save: Path) -> None:
    files = {r: src / f"rank_{r}" / f"checkpoint_{r}.safetensors" for r in range(4)}
    convert_checkpoint_by_rank(1, files, save, w.tp4, w.dp2tp2)


def _make_world(root: Path) -> World:
    tp4 = _strategy(root / "tp4.json", 1, 4)
    w = World(root, root / "A", root / "O", tp4, _strategy(root / "tp2.json", 1, 2),
              _strategy(root / "dp2tp2.json", 2, 2), make_full(SHAPES, seed=3))  # fmt: skip
    shard_checkpoint(write_full(w.full, root / "A_hf"), w.new_src, tp4)
    shard_checkpoint(write_full(make_full(SHAPES, seed=1), root / "O_hf"), w.old_src, tp4)
    # an older conversion (other weights, 2 ranks) plus files no conversion writes
    old = root / "old" / "tree"
    convert_checkpoints(w.old_src, old, "checkpoint_", tp4, w.tp2)
    (old / "notes.txt").write_text("keep me")
    (old / "logs").mkdir()
    (old / "logs" / "run.txt").write_text("keep the logs")
    w.old["tree"] = old
    _unify(w, w.old_src, root / "old" / "unified", size=2000)
    w.old["unified"] = root / "old" / "unified"
    (root / "old" / "file").mkdir()
    _by_rank(w, w.old_src, root / "old" / "file" / "rank1.safetensors")
    w.old["file"] = root / "old" / "file"
    # the new outputs, written by an uninterrupted run over a copy of each old one
    for kind, run in (("tree", _convert), ("unified", _unify)):
        ref = root / "new" / kind
        shutil.copytree(w.old[kind], ref, symlinks=True)
        run(w, w.new_src, ref)
        w.new[kind] = _snapshot(ref)
    ref = root / "new" / "file"
    shutil.copytree(w.old["file"], ref)
    _by_rank(w, w.new_src, ref / "rank1.safetensors")
    w.new["file"] = _snapshot(ref)
    return w


@dataclass(frozen=True)
class Case:
    """One killed run: the command, the point it is killed at, and what it must leave."""

    point: str
    command: str  # "convert", "convert -j2", "no exchange", "fresh", "unify", "by rank"
    expect: str  # "old", "new" or "missing" (the old tree lies complete beside the destination)

    @property
    def kind(self) -> str:
        return {"unify": "unified", "by rank": "file"}.get(self.command, "tree")


CASES = {
    "before any output": Case("staged", "convert", "old"),
    "after 2 of 4 ranks, 2 writers": Case("written-2", "convert -j2", "old"),
    "all written, before publishing": Case("publish", "convert", "old"),
    "old entries carried over, just before the swap": Case("swap", "convert", "old"),
    "just after the swap": Case("swapped", "convert", "new"),
    "while deleting the old tree": Case("published", "convert", "new"),
    "unify, just after the swap": Case("swapped", "unify", "new"),
    "unify, after 1 shard": Case("written-1", "unify", "old"),
    "no exchange: old tree moved aside": Case("fallback-aside", "no exchange", "missing"),
    "no exchange: just before the swap": Case("swap", "no exchange", "old"),
    "new destination, before it appears": Case("publish", "fresh", "absent"),
    "single file, before its rename": Case("file-publish", "by rank", "old"),
}


def _spec(w: World, case: Case, dst: Path, marker: Path) -> dict:
    """What the launcher runs for ``case``: CLI arguments or an API call, and the test hook."""
    spec = {
        "env": {PAUSE_ENV: case.point, PAUSE_MARKER_ENV: str(marker)},
        "log": str(marker.with_suffix(".log")),
        "no_exchange": case.command == "no exchange",
        "by_rank": None,
        "argv": ["ckpt", "convert", str(w.new_src), str(dst), "--src-strategy", str(w.tp4),
                 "--dst-strategy", str(w.dp2tp2), "--no-progress"],
    }  # fmt: skip
    if case.command == "convert -j2":
        spec["argv"] += ["-j", "2"]
    elif case.command == "unify":
        spec["argv"] = ["ckpt", "unify", str(w.new_src), str(dst), "--strategy", str(w.tp4),
                        "--max-shard-size", "600", "--no-progress"]  # fmt: skip
    elif case.command == "by rank":
        files = {r: str(w.new_src / f"rank_{r}" / f"checkpoint_{r}.safetensors") for r in range(4)}
        spec["by_rank"] = [1, files, str(dst / "rank1.safetensors"), str(w.tp4), str(w.dp2tp2)]
    return spec


@dataclass
class Killed:
    dst: Path
    exit_status: int
    workers_alive: list[int]


def _wait_for(marker: Path, pid: int, timeout: float = 60.0) -> None:
    """Wait until process ``pid`` reaches its pause point (it creates ``marker``) or dies."""
    deadline = time.monotonic() + timeout
    log = marker.with_suffix(".log")
    while not marker.exists():
        try:
            dead = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            dead = True
        if dead:
            raise AssertionError(f"exited before its pause point:\n{log.read_text()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"did not reach its pause point in {timeout}s")
        time.sleep(0.01)


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> tuple[World, dict[str, Killed]]:
    """Start every case's run at once, kill each at its point, return what they left."""
    w = _make_world(tmp_path_factory.mktemp("world"))
    specs, dsts, markers = [], [], []
    for i, case in enumerate(CASES.values()):
        parent = tmp_path_factory.mktemp(f"case{i}")
        dst = parent / "dst"
        if case.expect != "absent":
            shutil.copytree(w.old[case.kind], dst, symlinks=True)
        marker = parent.with_name(parent.name + ".paused")
        specs.append(json.dumps(_spec(w, case, dst, marker)) + "\n")
        dsts.append(dst)
        markers.append(marker)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC_DIR, os.environ.get("PYTHONPATH", "")])}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    out: dict[str, Killed] = {}
    try:
        launcher.stdin.write("".join(specs))
        launcher.stdin.close()
        pids = [int(launcher.stdout.readline()) for _ in specs]
        alive = []
        for pid, marker in zip(pids, markers, strict=True):
            _wait_for(marker, pid)
            assert marker.read_text() == str(pid)
            workers = psutil.Process(pid).children(recursive=True)
            os.kill(pid, signal.SIGKILL)
            alive.append(workers)
        status = dict(map(int, launcher.stdout.readline().split()) for _ in specs)
        for name, pid, dst, workers in zip(CASES, pids, dsts, alive, strict=True):
            _, left = psutil.wait_procs(workers, timeout=15)  # they die with their parent
            out[name] = Killed(dst, status[pid], [p.pid for p in left])
    finally:
        if launcher.poll() is None:
            for p in psutil.Process(launcher.pid).children(recursive=True):
                p.kill()
            launcher.kill()
        launcher.wait()
        launcher.stdout.close()
    return w, out


@pytest.mark.parametrize("name", list(CASES))
def test_kill_leaves_old_or_new_and_next_run_recovers(killed, name):
    w, runs = killed
    case, run = CASES[name], runs[name]
    assert run.exit_status == -signal.SIGKILL
    assert run.workers_alive == []
    dst, parent = run.dst, run.dst.parent
    old, new = _snapshot(w.old[case.kind]), w.new[case.kind]
    if case.kind == "file":  # a single file's temporary lies beside it, hidden
        assert all(".rank1.safetensors.tessel-tmp-" in n for n in _hidden(dst))
        parent = dst
    got = _snapshot(dst)
    if case.expect == "old":
        assert got == old
    elif case.expect == "new":
        assert got == new
    elif case.expect == "absent":
        assert got is None  # the destination appears only when complete
    else:  # between the two renames of the fallback: the old tree lies complete beside dst
        assert got is None
        aside = [parent / n for n in _hidden(parent) if ".tessel-old-" in n]
        assert len(aside) == 1 and _snapshot(aside[0]) == old
    if got is not None and case.kind != "file":  # leftovers are never inside a destination
        assert not [p for p in dst.rglob("*") if ".tessel-" in p.name]

    # the next run succeeds, gives the new output and clears every leftover
    if case.kind == "tree":
        _convert(w, w.new_src, dst)
        expect_new = new if case.expect != "absent" else None
        st = load_strategy(w.dp2tp2)
        for r in range(4):
            got_r = load_file(str(dst / f"rank_{r}" / f"checkpoint_{r}.safetensors"))
            want = ref_rank_slices(w.full, st, r)
            assert set(got_r) == set(want) and all(torch.equal(got_r[k], want[k]) for k in want)
    elif case.kind == "unified":
        _unify(w, w.new_src, dst)
        expect_new = new
    else:
        _by_rank(w, w.new_src, dst / "rank1.safetensors")
        expect_new = new
    if expect_new is not None:
        assert _snapshot(dst) == expect_new
    assert _hidden(parent) == []


def test_live_runs_staging_is_not_taken_for_a_leftover(tmp_path):
    """A second run clears only leftovers of dead runs, never the tree a live run is writing."""
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "a.txt").write_text("old")
    with StagedTree(dst) as first:
        (first.path / "a.txt").write_text("first")
        with StagedTree(dst) as second:
            assert first.path.exists() and second.path.exists()
            (second.path / "a.txt").write_text("second")
            second.publish()
        assert first.path.exists() and (dst / "a.txt").read_text() == "second"
        first.publish()
    assert (dst / "a.txt").read_text() == "first" and _hidden(tmp_path) == []
