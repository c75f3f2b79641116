"""Every checkpoint writer, killed (SIGKILL) at any moment or stopped by a full disk, leaves the
old checkpoint whole or the new one whole, never a mix, and no staging directory behind.

Writers (each running what ``tessel ckpt ...`` runs, calling the API, or saving a training
session's checkpoint) are started over a destination that holds an older complete checkpoint
of more ranks (4) than the new one (2) and files that are no checkpoint's (notes, logs). The
test hook ``TESSEL_TEST_PAUSE_AT`` makes each stop at a named point and create a marker file;
the test waits for the marker (an event, no sleeps to guess timing), kills the process with
SIGKILL and checks the destination file by file against the old and the new checkpoint: the
tensors, the checkpoint id every safetensors file records (one id, the old one or the new one)
and the files of other names. Other writers run with the size of the files they may write
limited (RLIMIT_FSIZE, set for the writer's own processes: a disk that fills partway through a
file), and must fail with tessel's error, leaving the old checkpoint. Then the writer runs
again and must succeed and clear what the killed run left behind.
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
from tessel.checkpoint.errors import CheckpointError
from tessel.checkpoint.publish import PAUSE_ENV, PAUSE_MARKER_ENV, StagedTree
from tessel.checkpoint.strategy import load_strategy
from tessel.parallel import (
    convert_checkpoint_by_rank,
    convert_checkpoints,
    shard_checkpoint,
    unified_safetensors,
)

from .helpers import (
    SMALL_SHAPES,
    checkpoint_ids,
    files_bytes,
    make_full,
    ref_rank_slices,
    small_strategy,
    write_full,
)

SHAPES = SMALL_SHAPES
SRC_DIR = str(Path(tessel.__file__).resolve().parents[1])  # the tessel this test imports
FSIZE = 400  # bytes a writer's file may grow to in the full-disk cases: every output is larger
# Starts one writer process per line of JSON on stdin and prints its pid; at end of input
# prints "pid exit-status" for each. Each process is forked from this one after torch and tessel
# are imported, so a dozen of them start in well under a second instead of seconds apiece; each
# then runs exactly what `tessel ckpt ...` runs (tessel.cli.main), calls the API, or loads a
# training package into a Session, takes a step and saves its checkpoint.
LAUNCHER = """
import json, os, resource, sys, traceback
import psutil, torch
import tessel
from tessel.cli import main
from tessel.checkpoint import publish
from tessel.parallel import convert_checkpoint_by_rank
import tessel.builder.options, tessel.checkpoint.cli, tqdm  # what main() imports

def limit(pid, size):  # soft limit only: this process raises it again to report its error
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (size, resource.RLIM_INFINITY))

def saves(package, jobs, status_file):
    # One session for every save_checkpoint case (a session's start costs seconds: its workers'
    # fork server imports torch). A save to be killed runs in a process forked from this one, a
    # copy of the session process whose workers are this one's; the full-disk save runs here,
    # last, as it stops the workers.
    tessel.initialize({"ge.graphRunMode": "1"})
    session = tessel.Session()
    session.load_graph(0, {}, package)
    torch.manual_seed(0)
    session.run_graph(0, {"x": torch.randn(4, 8), "y": torch.randn(4, 4)})
    status = {}
    for job in jobs:
        if job["fsize"] is None:
            pid = os.fork()
            if pid == 0:
                fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.environ.update(job["env"])
                try:
                    session.save_checkpoint(0, job["dst"])
                    code = 0
                except BaseException:
                    traceback.print_exc()
                    code = 1
                sys.stdout.flush()
                os._exit(code)
            status[job["name"]] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            continue
        # the workers write the rank files, this process the model's files: their disk fills
        for p in psutil.Process().children(recursive=True):
            limit(p.pid, job["fsize"])
        limit(0, job["fsize"])
        try:
            session.save_checkpoint(0, job["dst"])
            error, status[job["name"]] = "", 0
        except BaseException:
            limit(0, resource.RLIM_INFINITY)
            error, status[job["name"]] = traceback.format_exc(), 1
        limit(0, resource.RLIM_INFINITY)
        with open(job["log"], "w") as f:
            f.write(error)
    with open(status_file, "w") as f:
        json.dump(status, f)
    tessel.finalize()

def run(spec):
    fd = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    if "saves" in spec:
        return saves(*spec["saves"])
    os.environ.update(spec["env"])
    if spec["no_exchange"]:  # as on a file system that cannot exchange two directories
        publish.exchange = lambda a, b: False
    if spec["fsize"]:
        limit(0, spec["fsize"])
    try:
        if spec["by_rank"]:
            rank, files, save_file, src, dst = spec["by_rank"]
            files = {int(r): f for r, f in files.items()}
            convert_checkpoint_by_rank(rank, files, save_file, src, dst)
            return 0
        return main(spec["argv"])
    finally:
        limit(0, resource.RLIM_INFINITY)

pids = []
for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        try:
            code = run(json.loads(line)) or 0
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        os._exit(code)
    pids.append(pid)
    print(pid, flush=True)
for pid in pids:
    print(pid, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


def _snapshot(d: Path) -> dict[str, str] | None:
    """SHA-256 of every file under ``d`` by relative path, checkpoint ids blanked and hidden
    files left out; None if ``d`` does not exist."""
    if not d.exists():
        return None
    files = files_bytes(d)
    return {k: hashlib.sha256(v).hexdigest() for k, v in files.items() if not k.startswith(".")}


def _ids(d: Path) -> set[str | None]:
    """The checkpoint ids the safetensors files under ``d`` record."""
    return set(checkpoint_ids(d).values())


def _hidden(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


class Tiny(torch.nn.Module):
    """A two-layer model whose training package saves a 2-rank checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.b(torch.relu(self.a(x))), y)


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
    package: Path  # a training package whose Session saves a 2-rank checkpoint
    old: dict[str, Path] = field(default_factory=dict)  # kind -> pristine old output
    new: dict[str, dict | None] = field(default_factory=dict)  # kind -> snapshot of new output


def _convert(w: World, src: Path, dst: Path, overwrite: bool = True) -> None:
    convert_checkpoints(src, dst, "checkpoint_", w.tp4, w.tp2, overwrite=overwrite)


def _unify(w: World, src: Path, dst: Path, size: int = 600) -> None:
    unified_safetensors(src, w.tp4, dst, max_shard_size=size, overwrite=True)


def _by_rank(w: World, src: Path, save: Path) -> None:
    files = {r: src / f"rank_{r}" / f"checkpoint_{r}.safetensors" for r in range(4)}
    convert_checkpoint_by_rank(1, files, save, w.tp4, w.dp2tp2)


def _make_world(root: Path) -> World:
    tp4 = small_strategy(root / "tp4.json", 1, 4)
    torch.manual_seed(0)
    model = Tiny()
    package = tessel.build(
        model,
        {"x": torch.randn(4, 8), "y": torch.randn(4, 4)},
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        cluster=2,
    ).save(root / "tiny")
    w = World(root, root / "A", root / "O", tp4, small_strategy(root / "tp2.json", 1, 2),
              small_strategy(root / "dp2tp2.json", 2, 2), make_full(SHAPES, seed=3),
              Path(package))  # fmt: skip
    shard_checkpoint(write_full(w.full, root / "A_hf"), w.new_src, tp4)
    shard_checkpoint(write_full(make_full(SHAPES, seed=1), root / "O_hf"), w.old_src, tp4)
    # an older checkpoint (other weights, 4 ranks) plus files no writer writes
    old = root / "old" / "tree"
    convert_checkpoints(w.old_src, old, "checkpoint_", tp4, w.dp2tp2)
    (old / "notes.txt").write_text("keep me")
    (old / "logs").mkdir()
    (old / "logs" / "run.txt").write_text("keep the logs")
    w.old["tree"] = old
    _unify(w, w.old_src, root / "old" / "unified", size=4000)
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
    """One run: the command, the point it is killed at (None: it runs on a disk that fills),
    and what it must leave."""

    point: str | None
    command: str  # "convert", "convert -j2", "no exchange", "fresh", "unify", "shard", ...
    expect: str  # "old", "new", "missing" (the old tree lies complete beside the destination)

    @property
    def kind(self) -> str:
        """Which old output the destination starts as, and which new one it may become."""
        return {"unify": "unified", "by rank": "file"}.get(self.command, "tree")


CASES = {
    "before any output": Case("staged", "convert", "old"),
    "after 1 of 2 ranks, 2 writers": Case("written-1", "convert -j2", "old"),
    "all written, before publishing": Case("publish", "convert", "old"),
    "old entries carried over, just before the swap": Case("swap", "convert", "old"),
    "just after the swap": Case("swapped", "convert", "new"),
    "while deleting the old tree": Case("published", "convert", "new"),
    "unify, just after the swap": Case("swapped", "unify", "new"),
    "unify, after 1 shard": Case("written-1", "unify", "old"),
    "shard, just before the swap": Case("swap", "shard", "old"),
    "shard, just after the swap": Case("swapped", "shard", "new"),
    "no exchange: old tree moved aside": Case("fallback-aside", "no exchange", "missing"),
    "no exchange: just before the swap": Case("swap", "no exchange", "old"),
    "new destination, before it appears": Case("publish", "fresh", "absent"),
    "single file, before its rename": Case("file-publish", "by rank", "old"),
    "save_checkpoint, every rank written": Case("swap", "save", "old"),
    "save_checkpoint, just after the swap": Case("swapped", "save", "saved"),
    "full disk: convert, 2 writers": Case(None, "convert -j2", "old"),
    "full disk: unify": Case(None, "unify", "old"),
    "full disk: shard": Case(None, "shard", "old"),
    "full disk: by rank": Case(None, "by rank", "old"),
    "full disk: save_checkpoint": Case(None, "save", "old"),
}


def _spec(w: World, case: Case, dst: Path, marker: Path) -> dict:
    """What the launcher runs for ``case``: CLI arguments, an API call or a Session's save, and
    the test hook or the file size limit."""
    spec = {
        "env": {PAUSE_ENV: case.point, PAUSE_MARKER_ENV: str(marker)} if case.point else {},
        "fsize": None if case.point else FSIZE,
        "log": str(marker.with_suffix(".log")),
        "no_exchange": case.command == "no exchange",
        "by_rank": None,
        "argv": ["ckpt", "convert", str(w.new_src), str(dst), "--src-strategy", str(w.tp4),
                 "--dst-strategy", str(w.tp2), "--no-progress", "--overwrite"],
    }  # fmt: skip
    if case.command == "convert -j2":
        spec["argv"] += ["-j", "2"]
    elif case.command == "unify":
        spec["argv"] = ["ckpt", "unify", str(w.new_src), str(dst), "--strategy", str(w.tp4),
                        "--max-shard-size", "600", "--no-progress", "--overwrite"]  # fmt: skip
    elif case.command == "shard":
        spec["argv"] = ["ckpt", "shard", str(w.root / "A_hf"), str(dst), "--strategy",
                        str(w.tp2), "--no-progress", "--overwrite"]  # fmt: skip
    elif case.command == "by rank":
        files = {r: str(w.new_src / f"rank_{r}" / f"checkpoint_{r}.safetensors") for r in range(4)}
        spec["by_rank"] = [1, files, str(dst / "rank1.safetensors"), str(w.tp4), str(w.dp2tp2)]
    return spec


@dataclass
class Ran:
    dst: Path
    exit_status: int
    workers_alive: list[int]
    log: str


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
def ran(tmp_path_factory) -> tuple[World, dict[str, Ran]]:
    """Start every case's run at once, kill each at its point (or let it fail on its full
    disk), return what they left."""
    w = _make_world(tmp_path_factory.mktemp("world"))
    specs, dsts, markers, saves = [], [], [], []
    for i, (name, case) in enumerate(CASES.items()):
        parent = tmp_path_factory.mktemp(f"case{i}")
        dst = parent / "dst"
        if case.expect != "absent":
            shutil.copytree(w.old[case.kind], dst, symlinks=True)
        marker = parent.with_name(parent.name + ".paused")
        dsts.append(dst)
        markers.append(marker)
        if case.command == "save":  # the saves run one after another in one session
            spec = _spec(w, case, dst, marker)
            job = {"name": name, "dst": str(dst), "log": spec["log"], "env": spec["env"]}
            saves.append({**job, "fsize": spec["fsize"]})
        else:
            specs.append(_spec(w, case, dst, marker))
    saves.sort(key=lambda job: job["fsize"] is not None)  # the full-disk save last
    status_file = w.root / "saves.json"
    specs.append({"saves": [str(w.package), saves, str(status_file)],
                  "log": str(w.root / "saves.log")})  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC_DIR, os.environ.get("PYTHONPATH", "")])}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    out: dict[str, Ran] = {}
    try:
        launcher.stdin.write("".join(json.dumps(spec) + "\n" for spec in specs))
        launcher.stdin.close()
        started = [int(launcher.stdout.readline()) for _ in specs]
        host = started[-1]  # the saves' session
        pids = iter(started)
        alive = {}
        for (name, case), marker in zip(CASES.items(), markers, strict=True):
            alive[name] = []
            runner = host if case.command == "save" else next(pids)
            if case.point is None:  # runs to its error
                continue
            _wait_for(marker, runner)
            pid = int(marker.read_text())
            assert pid == runner or case.command == "save"  # a save forked from the host
            alive[name] = psutil.Process(pid).children(recursive=True)
            os.kill(pid, signal.SIGKILL)
        status = dict(map(int, launcher.stdout.readline().split()) for _ in specs)
        assert status[host] == 0, (w.root / "saves.log").read_text()
        saved = json.loads(status_file.read_text())
        pids = iter(started)
        for (name, case), dst, marker in zip(CASES.items(), dsts, markers, strict=True):
            code = saved[name] if case.command == "save" else status[next(pids)]
            _, left = psutil.wait_procs(alive[name], timeout=15)  # they die with their parent
            out[name] = Ran(
                dst, code, [p.pid for p in left], marker.with_suffix(".log").read_text()
            )
    finally:
        if launcher.poll() is None:
            for p in psutil.Process(launcher.pid).children(recursive=True):
                p.kill()
            launcher.kill()
        launcher.wait()
        launcher.stdout.close()
    return w, out


SAVED = ["logs/run.txt", "model_state_dict.json", "notes.txt", "rank_0/checkpoint_0.safetensors",
         "rank_1/checkpoint_1.safetensors", "strategy.json"]  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_old_or_new_checkpoint_and_the_next_run_recovers(ran, name):
    w, runs = ran
    case, run = CASES[name], runs[name]
    if case.point is None:  # the disk filled: tessel's error, and the old checkpoint
        assert run.exit_status in (1, 2), run.log  # an error raised, or the CLI's
        assert "could not be written: " in run.log and "File too large" in run.log, run.log
        assert "unchanged" in run.log or "is as it was" in run.log, run.log
    else:
        assert run.exit_status == -signal.SIGKILL
    assert run.workers_alive == []
    dst, parent = run.dst, run.dst.parent
    old_dir = w.old[case.kind]
    old, new = _snapshot(old_dir), w.new[case.kind]
    if case.kind == "file":  # a single file's temporary lies beside it, hidden
        assert all(".rank1.safetensors.tessel-tmp-" in n for n in _hidden(dst))
        parent = dst
    got = _snapshot(dst)
    if case.expect == "old":  # byte for byte, its own id included
        assert got == old and checkpoint_ids(dst) == checkpoint_ids(old_dir)
    elif case.expect == "new":  # the new checkpoint, one id, and the old one's other files
        assert got == new
        (ident,) = _ids(dst)
        assert ident not in _ids(old_dir)
    elif case.expect == "saved":  # save_checkpoint's files only, of one checkpoint
        assert sorted(got) == SAVED
        (ident,) = _ids(dst)
        assert ident not in _ids(old_dir)
        assert (dst / "notes.txt").read_text() == "keep me"
    elif case.expect == "absent":
        assert got is None  # the destination appears only when complete
    else:  # between the two renames of the fallback: the old tree lies complete beside dst
        assert got is None
        aside = [parent / n for n in _hidden(parent) if ".tessel-old-" in n]
        assert len(aside) == 1 and _snapshot(aside[0]) == old
        with pytest.raises(CheckpointError, match=f"left the old checkpoint complete at "
                           f"{aside[0]}; the next tessel run"):  # fmt: skip
            convert_checkpoints(dst, parent / "elsewhere", "p", w.tp2, w.tp2)
    if got is not None and case.kind != "file":  # leftovers are never inside a destination
        assert not [p for p in dst.rglob("*") if ".tessel-" in p.name]
    if case.point is None:  # a failed run leaves nothing behind
        assert _hidden(parent) == []

    # the next run succeeds, gives the new output and clears every leftover
    if case.kind == "tree":
        _convert(w, w.new_src, dst)
        expect_new = new if case.expect != "absent" else None
        st = load_strategy(w.tp2)
        for r in range(2):
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
        assert len(_ids(dst)) == 1
    assert _hidden(parent) == []


def test_a_conversion_with_overwrite_leaves_no_file_of_the_old_checkpoint(ran):
    """A 2-rank conversion over a 4-rank checkpoint: its rank_2 and rank_3 are gone (they were
    kept beside the new rank_0 and rank_1 before), and so is the 1-shard unification's shard
    beside the new 3-shard one; the files of other names are kept."""
    w, _ = ran
    assert sorted(w.new["tree"]) == ["logs/run.txt", "notes.txt", "rank_0/checkpoint_0.safetensors",
                                     "rank_1/checkpoint_1.safetensors", "strategy.json"]  # fmt: skip
    assert load_strategy(w.old["tree"] / "strategy.json").world_size == 4
    assert "model-00001-of-00001.safetensors" in _snapshot(w.old["unified"])
    shards = [n for n in w.new["unified"] if n.endswith(".safetensors")]
    assert len(shards) > 1 and all(n.endswith(f"-of-{len(shards):05d}.safetensors") for n in shards)


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
