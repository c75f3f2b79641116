"""run_graph latency against torch's own tensor parallel.

Llama (4 layers, width 256, 8 heads, vocab 8192, seq 128, batch 4), fp32, on N CPU processes.
Side by side in one run:
  - tessel, planned for the default cluster (weights may stay replicated);
  - tessel, planned for devices too small for replicated weights (weights sharded), with the
    weights each rank holds against 1/N of the model's and the collectives a run issues;
  - torch tensor parallel: `parallelize_module` with ColwiseParallel/RowwiseParallel on the
    Megatron plan, the same model and threads per process. Its plan needs a process count that
    divides the heads; where N does not (3, 6), torch TP runs at the nearest counts that do, and
    tessel is compared with each.
Each figure is the median of 20 runs after 3 warm-up runs; torch TP takes the slowest rank. With
`--mesh`, every setting runs `--rounds` times, torch first in each round; the table shows the
medians over the rounds and the range of the per-round ratios.

With `--mesh 2x2`, four processes on a dp 2 x tp 2 mesh: torch runs the Megatron plan on the
`tp` axis of a 2-D DeviceMesh, each replica on its half of the batch, once with the outputs left
on the replicas and once with each replica's logits gathered to rank 0 and joined (the whole
batch in one place, as a Session returns it). tessel builds with the same sizes in the policy,
for 16 GB devices and for devices of twice a replica's least memory (its weights sharded), and
runs each build twice: with its workers' default of returning each large activation's memory
when freed (a worker holds what its program holds), and with `tessel.reuse_freed_memory`
(glibc's own policy, which torch's processes run with).

    python benchmarks/bench_run.py [--devices 2 4]
    python benchmarks/bench_run.py --devices 3 4 6 --tight-only   # shards that do not divide
    python benchmarks/bench_run.py --mesh 2x2 [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp

LAYERS, HIDDEN, HEADS, VOCAB, SEQ, BATCH = 4, 256, 8, 8192, 128, 4
WARMUP, REPEAT = 3, 20


def llama():
    from transformers import LlamaForCausalLM

    from tessel.demo import llama_config

    torch.manual_seed(0)
    cfg = llama_config(LAYERS, HIDDEN, HEADS, vocab=VOCAB)
    return LlamaForCausalLM(cfg).eval()


def inputs() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def megatron_plan() -> dict:
    """torch TP's plan for the Llama: attention and MLP projections column- then row-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        plan.update(
            {
                p + "self_attn.q_proj": ColwiseParallel(),
                p + "self_attn.k_proj": ColwiseParallel(),
                p + "self_attn.v_proj": ColwiseParallel(),
                p + "self_attn.o_proj": RowwiseParallel(),
                p + "mlp.gate_proj": ColwiseParallel(),
                p + "mlp.up_proj": ColwiseParallel(),
                p + "mlp.down_proj": RowwiseParallel(),
            }
        )
    return plan


def _tp_rank(
    rank: int, world: int, port: int, threads: int, out: dict, dp: int = 1, gather: bool = False
) -> None:
    """One torch TP process; with `gather`, each replica's logits then go to rank 0, which
    puts the whole batch together (what a tessel Session returns)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    model = llama()
    rows = BATCH // dp
    replica = mesh.get_local_rank("dp")
    ids = inputs()[replica * rows : (replica + 1) * rows]
    with torch.no_grad():
        reference = model(input_ids=ids, use_cache=False).logits
    parallelize_module(model, mesh["tp"], megatron_plan())
    times = []
    with torch.no_grad():
        for i in range(WARMUP + REPEAT):
            dist.barrier()
            t = time.perf_counter()
            logits = model(input_ids=ids, use_cache=False).logits
            if gather and dp > 1 and mesh.get_local_rank("tp") == 0:
                group = mesh.get_group("dp")
                parts = [torch.empty_like(logits) for _ in range(dp)] if rank == 0 else None
                dist.gather(logits, parts, group=group, group_dst=0)
                whole = torch.cat(parts) if rank == 0 else None
            dist.barrier()
            if i >= WARMUP:
                times.append(time.perf_counter() - t)
    worst = torch.tensor(times)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        out["median_ms"] = 1e3 * statistics.median(worst.tolist())
        out["max_abs_diff"] = (logits - reference).abs().max().item()
        if gather and dp > 1:
            out["whole_batch_rows"] = whole.shape[0]
    dist.barrier()
    dist.destroy_process_group()


def torch_tp(world: int, threads: int, dp: int = 1, gather: bool = False) -> dict:
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(
        _tp_rank, args=(world, _free_port(), threads, out, dp, gather), nprocs=world, join=True
    )
    result = dict(out)
    manager.shutdown()
    return result


def tessel_run(
    world: int, tight: bool, threads: int, dp: int = 1, reuse_memory: bool = False
) -> dict:
    import tessel
    from tessel.capture import capture
    from tessel.config.cluster import cluster_from_dict
    from tessel.demo import tight_cluster
    from tessel.plan import has_rule

    model = llama()
    ids = inputs()
    kwargs = {"input_ids": ids, "use_cache": False}
    with torch.no_grad():
        reference = model(**kwargs).logits
    policy = None
    if dp > 1:  # planned on one replica's half of the batch, over its tp devices
        from tessel.config.cluster import local_cluster_dict
        from tessel.config.parallel_option import parallel_option_from_dict

        half = {"input_ids": ids[: BATCH // dp], "use_cache": False}
        least = tight_cluster(capture(model, half, keep=has_rule), world // dp)["item_def"][0]
        data = local_cluster_dict(world)
        if tight:  # twice a replica's least (rank 0 also holds the whole batch's outputs)
            least_bytes = int(least["memory"].removeprefix("[DDR:")[:-2])
            data["item_def"][0]["memory"] = f"[DDR:{2 * least_bytes}B]"
        cluster = cluster_from_dict(data, "tight" if tight else "default")
        sizes = {
            "tensor_parallel_option": {"tensor_parallel_size": world // dp},
            "data_parallel_option": {"data_parallel_size": dp},
        }
        policy = parallel_option_from_dict({"graph_parallel_option": sizes}, "policy")
        built = tessel.build(model, kwargs, cluster=cluster, policy=policy)
    else:
        captured = capture(model, kwargs, keep=has_rule)
        if tight:
            cluster = cluster_from_dict(tight_cluster(captured, world), "tight")
        else:
            cluster = world
        built = tessel.build(captured, cluster=cluster)
    with tempfile.TemporaryDirectory() as tmp:
        path = built.save(os.path.join(tmp, "llama"))
        tessel.initialize()
        try:
            session = tessel.Session()
            options = {
                "tessel.threads_per_worker": threads,
                "tessel.reuse_freed_memory": reuse_memory,
            }
            session.load_graph(0, options, path)
            times = []
            for i in range(WARMUP + REPEAT):
                t = time.perf_counter()
                (logits,) = session.run_graph(0, [ids])
                if i >= WARMUP:
                    times.append(time.perf_counter() - t)
        finally:
            tessel.finalize()
    ranks = built.manifest.plan.ranks
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(r.weight_bytes for r in ranks)
    return {
        "median_ms": 1e3 * statistics.median(times),
        "max_abs_diff": (logits - reference).abs().max().item(),
        "weight_MiB_per_rank": round(largest / 2**20, 2),
        "weight_share_x_N": round(largest / weights * world, 3),
        "collectives_per_run": max(len(r.collectives) for r in ranks),
    }


def eager(threads: int) -> float:
    torch.set_num_threads(threads)
    model = llama()
    ids = inputs()
    times = []
    with torch.no_grad():
        for i in range(WARMUP + REPEAT):
            t = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            if i >= WARMUP:
                times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def peer_counts(world: int) -> list[int]:
    """The process counts torch TP's Megatron plan runs at nearest `world`: it needs a count that
    divides the heads (and so the width of every sharded projection)."""
    if HEADS % world == 0:
        return [world]
    supported = [n for n in range(1, HEADS + 1) if HEADS % n == 0]
    gap = min(abs(n - world) for n in supported)
    return [n for n in supported if abs(n - world) == gap]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--tight-only", action="store_true", help="only the build whose weights must be sharded"
    )
    parser.add_argument("--mesh", help="dp x tp, such as 2x2: tessel and torch on a 2-D mesh")
    parser.add_argument(
        "--rounds", type=int, default=3, help="with --mesh: rounds of every setting, medians shown"
    )
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    if args.mesh:
        dp, tp = (int(x) for x in args.mesh.split("x"))
        world, threads = dp * tp, max(1, cores // (dp * tp))
        # four processes share this machine's cores, so one session's figure moves with where
        # the scheduler puts them: every round runs both peers and each tessel setting afresh
        peers: dict[bool, list[float]] = {False: [], True: []}
        found: dict[tuple[bool, bool], list[dict]] = {}
        for round_ in range(args.rounds):
            for gather in (False, True):
                peer = torch_tp(world, threads, dp, gather)
                peers[gather].append(peer["median_ms"])
                print(f"round {round_}: torch TP, gather={gather}: {json.dumps(peer)}")
            for tight in (False, True):
                for reuse in (False, True):
                    ours = tessel_run(world, tight, threads, dp, reuse)
                    ours["ratios"] = [ours["median_ms"] / peers[g][-1] for g in (False, True)]
                    found.setdefault((tight, reuse), []).append(ours)
                    print(
                        f"round {round_}: tessel, tight={tight}, reuse_freed_memory={reuse}: "
                        f"{json.dumps(ours)}",
                        flush=True,
                    )
        left, whole = (statistics.median(peers[g]) for g in (False, True))
        print(
            f"\ntorch TP, outputs left on the replicas: {left:.1f} ms; "
            f"with the replicas' logits gathered to rank 0: {whole:.1f} ms "
            f"(medians of {args.rounds} rounds)\n"
        )
        print(
            f"{'mesh':<6} {'tessel devices':<22} {'freed memory':<13} {'weights x N':>11} "
            f"{'tessel ms':>9} {'ratio (range) to TP':>21} {'to TP + gather':>16} {'max diff':>9}"
        )
        for (tight, reuse), runs in found.items():
            label = "2x a replica's least" if tight else "16 GB"
            cells = []
            for g in (0, 1):
                ratios = [r["ratios"][g] for r in runs]
                cells.append(
                    f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
                )
            print(
                f"{args.mesh:<6} {label:<22} {'reused' if reuse else 'returned':<13} "
                f"{runs[0]['weight_share_x_N']:>11.3f} "
                f"{statistics.median(r['median_ms'] for r in runs):>9.1f} "
                f"{cells[0]:>21} {cells[1]:>16} {max(r['max_abs_diff'] for r in runs):>9.1e}"
            )
        return
    print(f"single process, {cores} threads: {eager(cores):.1f} ms", flush=True)
    peers: dict[int, dict] = {}
    rows = []
    for world in args.devices:
        threads = max(1, cores // world)
        for n in peer_counts(world):
            if n not in peers:
                peers[n] = torch_tp(n, max(1, cores // n))
                print(f"torch TP x{n}: {json.dumps(peers[n])}", flush=True)
        for tight in (True,) if args.tight_only else (False, True):
            ours = tessel_run(world, tight, threads)
            label = "tessel (weights sharded)" if tight else "tessel (default cluster)"
            print(f"{label} x{world}: {json.dumps(ours)}", flush=True)
            for n in peer_counts(world):
                rows.append((world, label, ours, n, peers[n]["median_ms"]))
    print()
    print(
        f"{'procs':>5}  {'runtime':<26} {'weights x N':>11} {'collectives':>11} "
        f"{'tessel ms':>9} {'torch TP ms':>14} {'ratio':>6} {'max diff':>9}"
    )
    for world, label, ours, n, peer in rows:
        print(
            f"{world:>5}  {label:<26} {ours['weight_share_x_N']:>11.3f} "
            f"{ours['collectives_per_run']:>11} {ours['median_ms']:>9.1f} "
            f"{peer:>9.1f} (x{n}) {ours['median_ms'] / peer:>6.2f} {ours['max_abs_diff']:>9.1e}"
        )


if __name__ == "__main__":
    main()
