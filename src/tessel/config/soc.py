"""Documented defaults per `--soc_version`: what a device can do when the cluster file is silent.

Figures are public peak numbers; the cost model only needs their ratios to be right.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessel.config.errors import ConfigError

GiB = 1024**3


@dataclass(frozen=True)
class SocProfile:
    name: str
    device_type: str  # the torch device type its workers use: cpu, cuda, npu
    backend: str  # the torch.distributed backend: gloo, nccl, hccl
    peak_flops: float  # fp32 FLOP/s per device
    memory_bandwidth: float  # bytes/s
    memory_bytes: int  # device memory
    link_bandwidth: float  # bytes/s between devices of one node
    network_bandwidth: float  # bytes/s between nodes
    link_latency: float  # seconds per collective step (alpha)
    # measured for "cpu" alone; 0 where not measured (a GPU's launches overlap its kernels)
    op_overhead: float = 0.0  # seconds of host time to dispatch one operator of a program
    run_overhead: float = 0.0  # seconds a run costs beside its program (the session's pipe)
    # how much slower each CPU device runs, beyond its share of the cores, when a node's
    # devices outnumber its cores (the switches between their processes)
    shared_core_slowdown: float = 1.0


SOCS: dict[str, SocProfile] = {
    p.name: p
    for p in [
        # Local CPU processes talking through gloo over loopback; the planner divides the
        # compute figures among the devices that share one host's cores. Measured with
        # `benchmarks/bench_estimate.py --micro` on a 2-core AMD EPYC (AVX2, FMA) on a quiet
        # host: one thread's 256x256 matmul runs at 100 GFLOP/s and a 16 MiB copy at 40
        # GB/s, shared by the processes copying at once; a program's operators, smaller and
        # of other shapes, reach about half of each (50 GFLOP/s per core and 20 GB/s per
        # host keep `bench_estimate` within its band at widths 64 and 256). A lowered
        # program spends about 5 us of host time per operator beside its arithmetic
        # (1-device programs of the differential zoo: 4.2-6.2 us per call), which at the
        # zoo's sizes is most of a run; a view takes 0.4 of that (`cost.VIEW_DISPATCH`) and
        # an item of a tuple nothing; a run_graph of one operator takes about 1 ms (the
        # session's pipe to rank 0 and back). A collective between processes that were
        # computing costs about 0.5 ms a step at 2 processes (a gloo all_gather between
        # operators, against 0.15 ms for back-to-back collectives of idle processes): 400 us
        # weighs the two as programs mix them; a program's all-reduce pays it once, as its
        # workers meet in shared memory (`cost.Links.one_pass`). 3 and 4 processes on the 2
        # cores run their operators 1.25-1.4x slower than their 2/3 and 1/2 share of the cores.
        SocProfile("cpu", "cpu", "gloo", 50e9, 20e9, 16 * GiB, 1e9, 1e9, 400e-6, 5e-6, 1e-3, 1.35),
        SocProfile("A100", "cuda", "nccl", 19.5e12, 2.0e12, 80 * GiB, 300e9, 25e9, 8e-6),
        SocProfile("H100", "cuda", "nccl", 67e12, 3.35e12, 80 * GiB, 450e9, 50e9, 6e-6),
        SocProfile("H200", "cuda", "nccl", 67e12, 4.8e12, 141 * GiB, 450e9, 50e9, 6e-6),
        SocProfile("Ascend910B", "npu", "hccl", 94e12, 1.6e12, 64 * GiB, 56e9, 25e9, 10e-6),
        SocProfile("Ascend910", "npu", "hccl", 64e12, 1.2e12, 32 * GiB, 30e9, 12.5e9, 10e-6),
    ]
}
_ALIASES = {"h200": "H200", "h100": "H100", "a100": "A100", "gpu": "H100", "cuda": "H100"}


def _lookup(name: str) -> SocProfile | None:
    key = name.strip()
    if key in SOCS:
        return SOCS[key]
    if key.lower() in _ALIASES:
        return SOCS[_ALIASES[key.lower()]]
    for family in ("Ascend910B", "Ascend910"):
        if key.startswith(family):
            return SOCS[family]
    return None


def is_known_soc(name: str) -> bool:
    """Whether `name` names a soc tessel has a profile for."""
    return _lookup(name) is not None


def soc_profile(name: str, source: str = "--soc_version") -> SocProfile:
    """The profile for a soc name; Ascend names with a suffix (Ascend910B1) map to their family."""
    profile = _lookup(name) if isinstance(name, str) else None
    if profile is None:
        raise ConfigError(source, None, f"unknown soc {name!r}; known: {', '.join(SOCS)}")
    return profile
