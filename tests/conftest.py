"""Shared fixtures: small real models from `transformers` with random weights, no downloads."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import pty
import select
import signal
import struct
import subprocess
import termios
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch
import torch.multiprocessing
from hypothesis import settings

from tessel.package.plan_report import PlanReport

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# every property test draws the same examples on every run (a fixed seed), wherever its own
# settings leave it unsaid
settings.register_profile("tessel", derandomize=True)
settings.load_profile("tessel")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a tessel subprocess: this checkout's code first, then the tests'."""
    paths = [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), **extra}


def on_a_terminal(argv: list[str], cwd: Path) -> tuple[int, str]:
    """Run `argv` with its standard error (and output) on a pseudo-terminal; its exit code and
    everything it wrote there."""
    leader, follower = pty.openpty()
    # a terminal of 100 columns (a new pseudo-terminal has none, and tqdm draws nothing there)
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    proc = subprocess.Popen(
        argv, cwd=cwd, env=subprocess_env(), stdin=subprocess.DEVNULL, stdout=follower,
        stderr=follower,
    )  # fmt: skip
    os.close(follower)
    chunks = []
    while True:
        ready, _, _ = select.select([leader], [], [], 600)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(leader, 4096)
        except OSError:  # the other side closed: the process has ended
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    return proc.wait(), b"".join(chunks).decode(errors="replace")


class LogitsOnly(torch.nn.Module):
    """A causal LM that takes input ids and returns logits as a plain tensor."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, use_cache=False).logits


def hf_llama(
    layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 4, vocab: int = 256
):
    """A transformers Llama with random weights (seeded), called with input_ids and use_cache."""
    from transformers import LlamaForCausalLM

    from tessel.demo import llama_config

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(layers, hidden, heads, kv_heads, vocab)).eval()


def hf_gpt2(layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 256):
    """A transformers GPT-2 with random weights (seeded), called with input_ids and use_cache."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=vocab,
        n_positions=128,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg).eval()


def small_llama(
    layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 4, vocab: int = 256
):
    return LogitsOnly(hf_llama(layers, hidden, heads, kv_heads, vocab)).eval()


def small_gpt2(layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 256):
    return LogitsOnly(hf_gpt2(layers, hidden, heads, vocab)).eval()


def token_ids(batch: int = 2, seq: int = 16, vocab: int = 256, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


# what every rank a test starts needs, imported once by the fork server the ranks come from
_RANK_PRELOAD = [
    "torch",
    "torch.distributed.pipelining",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "tessel.parallel",
    "tessel.runtime.worker",
]


def start_ranks(fn: Callable[..., None], args: tuple, world: int) -> None:
    """Run `fn(rank, *args)` in `world` new processes and wait for them all, as torchrun
    starts ranks: each imports `fn`'s module afresh and shares nothing with this process.
    They are forked from multiprocessing's fork server (which runs no torch operator), not
    each started as an interpreter importing torch, transformers and tessel again (about 6 s
    of CPU a rank). A server this call starts imports `_RANK_PRELOAD` once; one a Session
    started earlier keeps its own preload (tessel's worker), and the ranks import the rest."""
    multiprocessing.set_forkserver_preload(_RANK_PRELOAD)
    torch.multiprocessing.start_processes(fn, args=args, nprocs=world, start_method="forkserver")


def is_multiprocessing_helper(p: psutil.Process) -> bool:
    """Python's multiprocessing resource tracker and the workers' fork server live as long as the
    test process, by design. The fork server's workers do not: they are forked from it, so they
    share its command line, and they are told apart by their parent, the server."""
    try:
        command = " ".join(p.cmdline())
        if "resource_tracker" in command:
            return True
        server = "multiprocessing.forkserver"
        return server in command and server not in " ".join(p.parent().cmdline())
    except (psutil.Error, AttributeError):  # gone, or no parent left
        return False


def signal_state(pid: int) -> str:
    """The blocked and ignored signal masks of process `pid` (Linux), for a failure message."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return " ".join(line.strip() for line in f if line.startswith(("SigBlk", "SigIgn")))
    except OSError as exc:
        return f"(no signal state: {exc})"


# how this test process began (a suite started in the background of a script begins with
# SIGINT ignored, as POSIX shells start background jobs)
_SIGINT_AT_START = signal.getsignal(signal.SIGINT)
_SIGINT_BLOCKED_AT_START = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])


@pytest.fixture(autouse=True)
def ctrl_c_still_works():
    """No test changes how this process takes Ctrl-C: the processes it starts later would
    inherit an ignored or blocked SIGINT (both survive exec) and never see Ctrl-C."""
    yield
    assert signal.getsignal(signal.SIGINT) == _SIGINT_AT_START, signal.getsignal(signal.SIGINT)
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert blocked == _SIGINT_BLOCKED_AT_START, "SIGINT's blocking changed"


def ctrl_c_as_in_a_terminal() -> None:
    """`preexec_fn` for a process a test sends Ctrl-C: SIGINT taken by default and unblocked,
    as in a user's terminal, whatever this test process inherited."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


@pytest.fixture(autouse=True)
def no_leftover_workers():
    """Every test must leave no worker process behind."""
    yield
    me = psutil.Process()
    children = [p for p in me.children(recursive=True) if not is_multiprocessing_helper(p)]
    gone, alive = psutil.wait_procs(children, timeout=10)
    for p in alive:
        p.kill()
    assert not alive, f"processes left behind: {[(p.pid, p.ppid(), p.status()) for p in alive]}"


# -- the memory model over the suite ------------------------------------------------------

# each build records (the planner's predicted peak, each rank's lowered peak, memory re-plans,
# strategies dropped) as the user property MEMORY_MODEL: properties travel to the controller
# with the reports, so the summary below sees every build, with or without pytest-xdist's workers
MEMORY_MODEL = "memory_model"


def record_memory_model(record_property, plan: PlanReport) -> None:
    """Records a build's predicted peak, each rank's lowered peak, its memory re-plans and the
    strategies its lowering dropped, for the summary below."""
    memory = plan.memory
    # rank 0 receives the outputs; the others have a peak of their own, and the last ranks of
    # an uneven split hold smaller shards (counted for one tensor-parallel group, without
    # replicas or stages)
    by_rank = list(memory.rank_peak_bytes)
    if len(by_rank) != len(plan.ranks):
        by_rank = [
            memory.peak_bytes if r == 0 else memory.other_ranks_peak_bytes
            for r in range(len(plan.ranks))
        ]
    record_property(
        MEMORY_MODEL,
        (
            [by_rank[rank.rank] for rank in plan.ranks],
            [rank.peak_bytes for rank in plan.ranks],
            sum(r.node == "(memory)" for r in plan.replanned),
            sum(r.node != "(memory)" for r in plan.replanned),
        ),
    )


def pytest_terminal_summary(terminalreporter) -> None:
    """How close the memory model came to the lowered programs, over the suite's builds."""
    builds = [
        (report.nodeid.split("[")[-1].rstrip("]"), value)
        for report in terminalreporter.stats.get("passed", [])
        for key, value in getattr(report, "user_properties", [])
        if key == MEMORY_MODEL
    ]
    if not builds:
        return
    ratios = [
        (name, peak / predicted)
        for name, (predictions, peaks, *_) in builds
        for predicted, peak in zip(predictions, peaks)
    ]
    within = sum(0.95 <= r <= 1.05 for _, r in ratios)
    # the fullest rank is the one the devices' memory is checked against
    fullest = [(name, max(peaks) / max(predictions)) for name, (predictions, peaks, *_) in builds]
    fullest_within = sum(0.95 <= r <= 1.05 for _, r in fullest)
    replans = sum(value[2] for _, value in builds)
    # strategies the lowering found DTensor runs otherwise than planned (each costs a re-plan)
    dropped = sum(value[3] for _, value in builds)
    worst = sorted(ratios, key=lambda x: abs(x[1] - 1))[-3:]
    terminalreporter.write_line(
        f"memory model: every rank's lowered peak within 5% of the planner's for it in {within} "
        f"of {len(ratios)} ranks, the fullest rank's in {fullest_within} of {len(builds)} builds "
        f"({replans} memory re-plans, {dropped} strategies dropped by the lowering); "
        "furthest ranks: " + ", ".join(f"{name} {r:.3f}" for name, r in reversed(worst))
    )
