"""Token generation (`Session.generate`) against transformers' `generate` and torch's tensor
parallel, in one run (issue 33's figures).

Llama (8 layers, width 1024, MLP 4096, 16 heads, 8 KV heads, vocab 32000: Llama-2's), fp32,
greedy: a prompt of 128 random tokens, 128 new tokens, batch 1 and 4, at 1, 2 and 4 devices.
tessel builds one package per device count and batch (its gears always run on the cache's
`max_batch_size` rows, so batch 1 gets a cache of one row), with one prefill gear of the
prompt's length and a cache of prompt + new tokens slots, as transformers' static cache has.
Side by side, each on the threads tessel's N workers use: a worker runs
`tessel.threads_per_worker` threads, by default the machine's cores split over the node's
workers, at least one each (`Session.load_graph`; `worker_main` sets it), so N x max(1, cores
// N) in all:
  - transformers: `model.generate(do_sample=False, cache_implementation="static")` in this
    process, `torch.set_num_threads` set to all N workers' threads;
  - torch tensor parallel: N processes over gloo, `parallelize_module` with the Megatron plan
    (q/k/v/gate/up column-wise, o/down row-wise) and the threads of one worker each, running
    transformers' static-cache greedy loop by hand (the prompt, then one token per step; every
    rank takes the same argmax of the whole logits). Its plan needs N to divide the heads and
    KV heads: at other counts it is skipped, and the tables say so.
tessel and transformers run in turn, a run of each per round (`side_by_side`), so a slow spell
of the machine falls on both; torch TP runs on its own before them. Figures, each the median of
`--repeat` runs (rounds) after one warm-up (torch TP: its slowest rank's):
  1. decode tokens/s: new tokens after the first x rows / the time from the first token to the
     last; tessel/peer, higher is better. Targets: >= 1.0x transformers, >= 0.9x torch TP;
  2. time to first token (the prompt's prefill and its token, from the call): peer/tessel,
     higher is better (above 1: tessel's first token comes sooner). tessel streams
     (`stream=True`): its first step gives TTFT, the rest the decode time; transformers hands
     the same steps to a streamer;
  3. the cache's bytes per rank as `tessel inspect --json` reports them (`generation.
     state_bytes_per_rank`, the largest rank) against 2 x layers x batch x KV heads x slots x
     head size x 4 bytes / N;
  4. the bytes a decode step reads on each rank (its weights and its cache: the rank's
     `weight_bytes` in `inspect --json`, which counts its cache too, less its part of the
     embedding table, of which a step reads one row per token) over the step's time, summed
     over the ranks, as a fraction of this machine's memory bandwidth: the bytes one process
     reads per second summing a 1 GiB fp32 tensor with all the workers' threads (gpt-fast's
     measure).
tessel's tokens must equal transformers' (checked on every setting); whether torch TP's do is
shown in its line. Settings run one after another; packages are built before any timing.
`--layers`, `--hidden` and `--vocab` change the model's sizes, for quick checks.

    python benchmarks/bench_generate.py [--devices 1 2 4] [--batches 1 4] [--repeat 3]
    python benchmarks/bench_generate.py --layers 2 --hidden 256 --new-tokens 16 --prompt 16 \
        --devices 1 2 --batches 1 --repeat 1   # a quick check
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

HEADS, KV_HEADS = 16, 8
MIB = 2**20


@dataclass(frozen=True)
class Setting:
    """The model's sizes and the request's lengths."""

    layers: int
    hidden: int
    vocab: int
    prompt: int
    new_tokens: int

    @property
    def slots(self) -> int:
        """The cache's tokens: the prompt and every new token, as transformers sizes it."""
        return self.prompt + self.new_tokens

    def cache_bytes(self, batch: int) -> int:
        """Keys and values of every layer, fp32, for `batch` rows."""
        return 2 * self.layers * batch * KV_HEADS * self.slots * (self.hidden // HEADS) * 4


def llama(s: Setting):
    """The Llama, the same weights in every process; it never stops at an EOS token, so every
    row makes every new token."""
    from transformers import LlamaForCausalLM

    from tessel.demo import llama_config

    torch.manual_seed(0)
    cfg = llama_config(s.layers, s.hidden, HEADS, KV_HEADS, vocab=s.vocab)
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, s.slots)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


def prompts(s: Setting, batch: int) -> torch.Tensor:
    return torch.randint(0, s.vocab, (batch, s.prompt), generator=torch.Generator().manual_seed(1))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


class Stamps:
    """Each step's new tokens and when they came, from this object's making (just before the
    call). A transformers streamer too: it hands over the prompt `[rows, prompt]` first, which
    is not a step, then each step's `[rows]`."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: list[float] = []
        self.tokens: list[torch.Tensor] = []

    def put(self, tokens: torch.Tensor) -> None:
        if tokens.dim() == 1:
            self.times.append(time.perf_counter())
            self.tokens.append(tokens)

    def end(self) -> None:
        pass

    @property
    def ttft(self) -> float:
        return self.times[0] - self.start

    @property
    def decode(self) -> float:
        return self.times[-1] - self.times[0]


def summary(s: Setting, rows: int, ttft: list[float], decode: list[float]) -> dict:
    """Median TTFT and decode time, and decode tokens/s (the tokens after the first)."""
    decode_s = statistics.median(decode)
    return {
        "ttft_ms": 1e3 * statistics.median(ttft),
        "decode_s": decode_s,
        "tokens_per_s": (s.new_tokens - 1) * rows / decode_s,
    }


def new_tokens(runs: list[Stamps]) -> torch.Tensor:
    return torch.stack(runs[-1].tokens, dim=1)


def transformers_call(model, s: Setting, batch: int, threads: int) -> Callable[[Stamps], None]:
    """One `generate` of transformers on `threads` threads, its steps handed to `stamps`."""
    ids = prompts(s, batch)

    def call(stamps: Stamps) -> None:
        with num_threads(threads), torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                cache_implementation="static",
                max_new_tokens=s.new_tokens,
                streamer=stamps,
            )

    return call


def side_by_side(calls: dict[str, Callable[[Stamps], None]], repeat: int) -> dict[str, list]:
    """One warm-up of each call, then `repeat` rounds running each once in turn: a slow spell
    of the machine (its load comes and goes for seconds at a time) falls on every peer alike
    rather than on whichever happened to run then."""
    for call in calls.values():
        call(Stamps())
    runs: dict[str, list[Stamps]] = {name: [] for name in calls}
    for _ in range(repeat):
        for name, call in calls.items():
            stamps = Stamps()
            call(stamps)
            runs[name].append(stamps)
    return runs


def result(s: Setting, rows: int, runs: list[Stamps]) -> dict:
    """The runs' summary and the last run's tokens."""
    out = summary(s, rows, [r.ttft for r in runs], [r.decode for r in runs])
    return {**out, "tokens": new_tokens(runs)}


def megatron_plan(layers: int) -> dict:
    """torch TP's plan for the Llama: attention and MLP projections column- then row-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            plan[p + name] = ColwiseParallel()
        plan[p + "self_attn.o_proj"] = RowwiseParallel()
        plan[p + "mlp.gate_proj"] = ColwiseParallel()
        plan[p + "mlp.up_proj"] = ColwiseParallel()
        plan[p + "mlp.down_proj"] = RowwiseParallel()
    return plan


def greedy(model, ids: torch.Tensor, cache, new: int) -> Iterator[torch.Tensor]:
    """transformers' static-cache greedy loop: the prompt, then one call per new token."""
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    for step in range(new):
        token = out.logits[:, -1].argmax(dim=-1)
        yield token
        if step < new - 1:
            out = model(input_ids=token[:, None], cache=cache, use_cache=True)


def _tp_rank(
    rank: int, world: int, port: int, threads: int, s: Setting, batch: int, repeat: int, out
) -> None:
    """One torch TP process: the Megatron plan, its own part of every layer's cache (the
    static cache takes its shape from the first keys it is given: this rank's heads)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import StaticCache

    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    model = llama(s)
    parallelize_module(model, init_device_mesh("cpu", (world,)), megatron_plan(s.layers))
    cache = StaticCache(config=model.config, max_cache_len=s.slots)
    ids = prompts(s, batch)

    def call(stamps: Stamps) -> None:
        cache.reset()
        dist.barrier()
        stamps.start = time.perf_counter()
        for token in greedy(model, ids, cache, s.new_tokens):
            stamps.put(token)

    with torch.no_grad():
        runs = side_by_side({"torch TP": call}, repeat)["torch TP"]
    slowest = torch.tensor([[r.ttft, r.decode] for r in runs])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        out.update(summary(s, batch, slowest[:, 0].tolist(), slowest[:, 1].tolist()))
        out["tokens"] = new_tokens(runs)
    dist.barrier()
    dist.destroy_process_group()


def torch_tp(world: int, threads: int, s: Setting, batch: int, repeat: int) -> dict:
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(
        _tp_rank,
        args=(world, _free_port(), threads, s, batch, repeat, out),
        nprocs=world,
        join=True,
    )
    result = dict(out)
    manager.shutdown()
    return result


def tessel_and_transformers(
    model, world: int, threads: int, s: Setting, batch: int, repeat: int
) -> tuple[dict, dict]:
    """Build the package, then time `Session.generate` streaming and transformers' `generate`
    on all of its workers' threads, in turn (`side_by_side`); tessel's figures come with those
    `tessel inspect --json` gives of each rank's weights and cache."""
    import tessel
    from tessel.report import inspect_json

    generation = tessel.Generation(
        max_batch_size=batch, max_seq_len=s.slots, prefill_lengths=(s.prompt,)
    )
    built = tessel.build(model, cluster=world, generation=generation)
    report = inspect_json(built.manifest)
    ids = prompts(s, batch)
    with tempfile.TemporaryDirectory() as tmp:
        path = tessel.save(built, os.path.join(tmp, "llama"))
        tessel.initialize()
        try:
            with tessel.Session() as session:
                session.load_graph(0, {"tessel.threads_per_worker": threads}, path)

                def call(stamps: Stamps) -> None:
                    mask = torch.ones_like(ids)
                    steps = session.generate(
                        0, ids, attention_mask=mask, max_new_tokens=s.new_tokens, stream=True
                    )
                    for step in steps:
                        stamps.put(step)

                hf = transformers_call(model, s, batch, world * threads)
                runs = side_by_side({"tessel": call, "transformers": hf}, repeat)
        finally:
            tessel.finalize()
    ours = {
        **result(s, batch, runs["tessel"]),
        "weight_bytes": [r["weight_bytes"] for r in report["ranks"]],
        "cache_bytes": report["generation"]["state_bytes_per_rank"],
        "table_bytes": table_bytes(s, world, report),
    }
    return ours, result(s, batch, runs["transformers"])


def table_bytes(s: Setting, world: int, report: dict) -> int:
    """The bytes of the embedding table each rank holds: whole where the plan replicates it,
    else its largest shard."""
    outside = report["layers"].get("(outside layers)", {})
    placement = outside.get("model.model.embed_tokens.weight", ["R"])  # one device: whole
    whole = s.vocab * s.hidden * 4
    return whole if placement == ["R"] else -(-whole // world)


def bandwidth(threads: int, repeat: int) -> float:
    """Bytes per second this process reads summing a 1 GiB fp32 tensor on `threads` threads."""
    data = torch.ones(2**28)
    with num_threads(threads):
        times = []
        for i in range(1 + repeat):
            t = time.perf_counter()
            data.sum()
            if i:
                times.append(time.perf_counter() - t)
    return data.numel() * data.element_size() / statistics.median(times)


def tp_divides(world: int) -> bool:
    return HEADS % world == 0 and KV_HEADS % world == 0


def same_tokens(label: str, got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether `got` equals transformers' `want`; where not, prints where each row departs."""
    if torch.equal(got, want):
        return True
    for row, (a, b) in enumerate(zip(got, want)):
        differ = (a != b).nonzero()
        if len(differ):
            i = int(differ[0])
            print(f"{label}: row {row} departs at new token {i}: {a[i:].tolist()}")
            print(f"{' ' * len(label)}  transformers' row {row} from there: {b[i:].tolist()}")
    return False


def show(label: str, result: dict) -> None:
    """A setting's figures as they come, its tokens left out."""
    print(f"{label}: {json.dumps({k: v for k, v in result.items() if k != 'tokens'})}", flush=True)


def ratio(num: float | None, den: float | None) -> str:
    return "-" if num is None or den is None else f"{num / den:.2f}"


def cell(value: float | None, fmt: str) -> str:
    return "skipped" if value is None else format(value, fmt)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024, help="a multiple of 16 (the heads)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs after one warm-up")
    args = parser.parse_args()
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2: decode is timed after the first token")
    if args.hidden % HEADS:
        parser.error(f"--hidden must be a multiple of the {HEADS} heads")
    s = Setting(args.layers, args.hidden, args.vocab, args.prompt, args.new_tokens)
    cores = os.cpu_count() or 1
    model = llama(s)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"Llama: {weights / MIB:.1f} MiB of weights; {cores} cores", flush=True)
    bandwidths: dict[int, float] = {}
    rows = []
    for world in args.devices:
        threads = max(1, cores // world)
        total = world * threads
        if total not in bandwidths:
            bandwidths[total] = bandwidth(total, args.repeat)
            print(f"bandwidth, {total} threads: {bandwidths[total] / 1e9:.1f} GB/s", flush=True)
        for batch in args.batches:
            label = f"x{world}, batch {batch}"
            tp = torch_tp(world, threads, s, batch, args.repeat) if tp_divides(world) else None
            ours, hf = tessel_and_transformers(model, world, threads, s, batch, args.repeat)
            show(f"transformers, {total} threads, batch {batch}", hf)
            ours["same_tokens"] = same_tokens(f"tessel {label}", ours["tokens"], hf["tokens"])
            if tp is not None:
                tp["same_tokens"] = same_tokens(f"torch TP {label}", tp["tokens"], hf["tokens"])
                show(f"torch TP {label}", tp)
            show(f"tessel {label}", ours)
            assert ours["same_tokens"], f"tessel's tokens differ from transformers' at {label}"
            rows.append((world, batch, threads, hf, tp, ours, bandwidths[total]))

    def figure(result: dict | None, key: str) -> float | None:
        return None if result is None else result[key]

    print(
        "\ndecode tokens/s (tessel/peer: higher is better; targets 1.0 and 0.9); threads: "
        "tessel's workers x each one's (torch TP's too; transformers runs them all in one)"
    )
    print(
        f"{'devices':>7} {'batch':>5} {'threads':>7} {'tessel':>8} {'HF':>8} {'torch TP':>8} "
        f"{'tessel/HF':>9} {'tessel/TP':>9}"
    )
    for world, batch, threads, hf, tp, ours, _ in rows:
        ours_s, hf_s, tp_s = (figure(r, "tokens_per_s") for r in (ours, hf, tp))
        print(
            f"{world:>7} {batch:>5} {f'{world}x{threads}':>7} {ours_s:>8.1f} {hf_s:>8.1f} "
            f"{cell(tp_s, '.1f'):>8} {ratio(ours_s, hf_s):>9} {ratio(ours_s, tp_s):>9}"
        )
    print("\ntime to first token, ms (peer/tessel: higher is better, above 1 tessel is sooner)")
    print(
        f"{'devices':>7} {'batch':>5} {'tessel':>8} {'HF':>8} {'torch TP':>8} "
        f"{'HF/tessel':>9} {'TP/tessel':>9}"
    )
    for world, batch, _, hf, tp, ours, _ in rows:
        ours_ms, hf_ms, tp_ms = (figure(r, "ttft_ms") for r in (ours, hf, tp))
        print(
            f"{world:>7} {batch:>5} {ours_ms:>8.1f} {hf_ms:>8.1f} {cell(tp_ms, '.1f'):>8} "
            f"{ratio(hf_ms, ours_ms):>9} {ratio(tp_ms, ours_ms):>9}"
        )
    print("\ntessel's cache per rank, and the bytes a decode step reads against the bandwidth")
    print(
        f"{'devices':>7} {'batch':>5} {'cache/rank MiB':>14} {'total/N MiB':>11} {'ratio':>5} "
        f"{'read/rank MiB':>13} {'GB/s':>6} {'machine GB/s':>12} {'fraction':>8}"
    )
    for world, batch, _, _, _, ours, machine in rows:
        cache = max(ours["cache_bytes"])
        even = s.cache_bytes(batch) / world
        # the rank's weights and cache; of the embedding table, a row per token
        read = [b - ours["table_bytes"] for b in ours["weight_bytes"]]
        rate = sum(read) * (s.new_tokens - 1) / ours["decode_s"]
        print(
            f"{world:>7} {batch:>5} {cache / MIB:>14.2f} {even / MIB:>11.2f} {cache / even:>5.2f} "
            f"{max(read) / MIB:>13.1f} {rate / 1e9:>6.1f} {machine / 1e9:>12.1f} "
            f"{rate / machine:>8.2f}"
        )
    skipped = [n for n in args.devices if not tp_divides(n)]
    if skipped:
        print(
            f"\ntorch TP skipped at {skipped} devices: its plan needs the count to divide the "
            f"{HEADS} heads and {KV_HEADS} KV heads"
        )


if __name__ == "__main__":
    main()
