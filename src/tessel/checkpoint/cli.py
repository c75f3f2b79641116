"""`tessel ckpt ...`: convert, unify, shard, plan and inspect distributed checkpoints."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `ckpt` command group to the tessel CLI."""
    p = subparsers.add_parser(
        "ckpt", help="convert, unify, shard and inspect distributed checkpoints"
    )
    p.set_defaults(func=lambda args: p.error("a ckpt subcommand is required"))
    sub = p.add_subparsers(dest="ckpt_command", metavar="SUBCOMMAND")

    c = sub.add_parser("convert", help="convert a distributed checkpoint to another strategy")
    c.add_argument("src", help="source dir: rank_{r}/*.safetensors, or a DCP directory")
    c.add_argument("dst", help="destination dir, new or empty (or see --overwrite): "
                   "rank_{r}/{dst_prefix}{r}.safetensors and strategy.json")  # fmt: skip
    c.add_argument("--src-strategy", help="source strategy file (default: SRC/strategy.json; "
                   "not needed for DCP)")  # fmt: skip
    c.add_argument("--dst-strategy", help="destination strategy file (default: unsharded)")
    c.add_argument("--dst-prefix", "--prefix", dest="dst_prefix", default="checkpoint_",
                   help="output file prefix (dst_prefix)")  # fmt: skip
    _common(c)
    c.set_defaults(func=_convert)

    u = sub.add_parser(
        "unify",
        help="merge into Hugging Face style full-tensor shards",
        description="Merge a distributed checkpoint into full-tensor shards "
        "(model-0000k-of-0000n.safetensors and model.safetensors.index.json in DST). "
        "A tessel training checkpoint (Session.save_checkpoint) gives the model's state_dict "
        "only, under its own keys, with the model's config.json and generation_config.json: "
        "a directory from_pretrained(DST) loads. Its optimizer states are written only with "
        "--optimizer-states DIR; the program's constants and non-persistent buffers never.",
    )
    u.add_argument("src", metavar="SRC",
                   help="source dir: rank_{r}/*.safetensors, or a DCP directory")  # fmt: skip
    u.add_argument("dst", metavar="DST",
                   help="output dir, new or empty (or see --overwrite): "
                   "model-0000k-of-0000n.safetensors + index; missing parent directories are "
                   "made")  # fmt: skip
    u.add_argument("--strategy", help="source strategy file (default: SRC/strategy.json; "
                   "not needed for DCP)")  # fmt: skip
    u.add_argument("--optimizer-states", metavar="DIR", dest="optimizer_states",
                   help="also write a tessel training checkpoint's optimizer states, as "
                   "optimizer-0000k-of-0000n.safetensors and optimizer.safetensors.index.json "
                   "in DIR (not DST)")  # fmt: skip
    u.add_argument("--max-shard-size", default="5GB", help="largest output shard (default 5GB)")
    _common(u)
    u.set_defaults(func=_unify)

    s = sub.add_parser("shard", help="pre-shard a Hugging Face checkpoint for a strategy")
    s.add_argument("hf_dir", help="directory of full-tensor safetensors (or a DCP directory)")
    s.add_argument("dst", help="destination dir, new or empty (or see --overwrite): "
                   "rank_{r}/{dst_prefix}{r}.safetensors and strategy.json")  # fmt: skip
    s.add_argument("--strategy", required=True, help="destination strategy file")
    s.add_argument("--dst-prefix", "--prefix", dest="dst_prefix", default="checkpoint_",
                   help="output file prefix (dst_prefix)")  # fmt: skip
    _common(s)
    s.set_defaults(func=_shard)

    r = sub.add_parser("ranks", help="source ranks needed to build one destination rank")
    r.add_argument("rank", type=int)
    r.add_argument("--src-strategy", help="source strategy file (none: unsharded source)")
    r.add_argument("--dst-strategy", help="destination strategy file (none: unsharded)")
    r.set_defaults(func=_ranks)

    i = sub.add_parser("inspect", help="describe a strategy file or a checkpoint directory")
    i.add_argument("path", help="strategy file, rank_{r} checkpoint dir, DCP dir or HF dir")
    i.add_argument("--strategy", help="strategy of a rank_{r} checkpoint directory")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(func=_inspect)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-j", "--process-num", "--processes", dest="process_num", type=int, default=1,
                   help="parallel writer processes (process_num)")  # fmt: skip
    p.add_argument("--overwrite", action="store_true",
                   help="write over a destination that is not empty: the checkpoint there "
                   "(rank_<r> directories, strategy.json, *.safetensors, their index, "
                   "model_state_dict.json, config.json, generation_config.json) is replaced "
                   "whole, none of its files left; files of other names (a tokenizer) are "
                   "kept. Without it a destination that is not empty is refused")  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _run(jobs, dst, args, forbidden, extra_files, source_dir) -> list[str]:
    from tqdm import tqdm

    from tessel.checkpoint.convert import execute, nbytes_of
    from tessel.progress import showing

    total = nbytes_of(jobs)
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"writing {len(jobs)} files",
        disable=args.no_progress or not showing(),  # a terminal only, above --log=error
        file=sys.stderr,
    )
    try:
        return execute(jobs, dst, args.process_num, bar.update, forbidden, extra_files,
                       overwrite=args.overwrite, sources=[source_dir])  # fmt: skip
    finally:
        bar.close()


def _convert(args: argparse.Namespace) -> int:
    from tessel.checkpoint.convert import check_destination
    from tessel.checkpoint.jobs import plan_convert

    check_destination(args.dst, [args.src], args.overwrite)
    jobs, source, files = plan_convert(
        src_dir=args.src,
        src_strategy_file=args.src_strategy,
        dst_strategy_file=args.dst_strategy,
        dst_prefix=args.dst_prefix,
        strategy_arg="--src-strategy",
    )
    out = _run(jobs, args.dst, args, source.holder_files(), files, args.src)
    print(f"wrote {len(out)} files to {args.dst}")
    return 0


def _unify(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tessel.checkpoint.api import OPTIMIZER_PREFIX, plan_unify, write_unified
    from tessel.checkpoint.errors import CheckpointError
    from tessel.progress import showing

    plan = plan_unify(args.src, args.strategy, args.max_shard_size, strategy_arg="--strategy")
    states = args.optimizer_states
    if states is not None:
        if not plan.recorded:
            raise CheckpointError(
                args.src, "--optimizer-states", "takes a tessel training checkpoint (one with "
                "model_state_dict.json, as Session.save_checkpoint writes); this one's tensors "
                "cannot be told apart, so all of them are written to DST: leave the flag out",
            )  # fmt: skip
        if Path(states).resolve() == Path(args.dst).resolve():
            raise CheckpointError(
                states, "--optimizer-states", "must be another directory than DST"
            )
    total = plan.model.total + (plan.optimizer.total if states is not None else 0)
    jobs = len(plan.model.jobs) + (len(plan.optimizer.jobs) if states is not None else 0)
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
               desc=f"writing {jobs} files", disable=args.no_progress or not showing(),
               file=sys.stderr)  # fmt: skip
    try:
        write_unified(plan, args.dst, states, args.process_num, bar.update,
                      overwrite=args.overwrite)  # fmt: skip
    finally:
        bar.close()
    if states is not None:
        print(f"wrote {len(plan.optimizer.jobs)} optimizer state shards "
              f"({_gib(plan.optimizer.total)}) and their index to {states}")  # fmt: skip
    print(f"wrote {len(plan.model.jobs)} shards ({_gib(plan.model.total)}) and their index"
          + "".join(f", {f}" for f in plan.files) + f" to {args.dst}")  # fmt: skip
    if plan.recorded:
        if states is None and plan.optimizer.weight_map:
            print(f"left out {len(plan.optimizer.weight_map)} optimizer states "
                  "(--optimizer-states DIR writes them)")  # fmt: skip
        if plan.left_out:
            shown = ", ".join(plan.left_out[:3]) + (", ..." if len(plan.left_out) > 3 else "")
            print(f"left out {len(plan.left_out)} other tensors the model's state_dict does "
                  "not take (tied copies, program constants, non-persistent buffers): "
                  f"{shown}")  # fmt: skip
    elif any(n.startswith(OPTIMIZER_PREFIX) for n in plan.model.weight_map):
        print(
            f"note: {args.src} has no model_state_dict.json (saved by an older tessel), so "
            "every tensor, optimizer states included, was written to DST",
            file=sys.stderr,
        )
    return 0


def _shard(args: argparse.Namespace) -> int:
    from tessel.checkpoint.convert import check_destination
    from tessel.checkpoint.jobs import rank_jobs, resolve_dst, strategy_file
    from tessel.checkpoint.sources import DCPSource, FullSource, is_dcp_dir
    from tessel.checkpoint.strategy import load_strategy

    check_destination(args.dst, [args.hf_dir], args.overwrite)
    source = DCPSource(args.hf_dir) if is_dcp_dir(args.hf_dir) else FullSource(args.hf_dir)
    dst = resolve_dst(load_strategy(args.strategy), source)
    jobs = rank_jobs(source, dst, args.dst_prefix)
    out = _run(jobs, args.dst, args, source.holder_files(), strategy_file(dst), args.hf_dir)
    print(f"wrote {len(out)} rank files to {args.dst}")
    return 0


def _ranks(args: argparse.Namespace) -> int:
    from tessel.checkpoint.api import rank_list_for_convert

    print(
        " ".join(map(str, rank_list_for_convert(args.rank, args.src_strategy, args.dst_strategy)))
    )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from tessel.checkpoint.convert import shape_bytes
    from tessel.checkpoint.jobs import open_source
    from tessel.checkpoint.sources import RankSource
    from tessel.checkpoint.strategy import load_strategy

    path = Path(args.path)
    rows = []
    if path.is_file():
        st = load_strategy(path)
        assert st is not None
        info = {
            "kind": "strategy",
            "stage_device_num": st.stage_device_num,
            "stages": st.num_stages,
            "world_size": st.world_size,
        }
        for n, p in st.params.items():
            rows.append({"name": n, **p.to_json()})
    else:
        source = open_source(path, args.strategy, strategy_arg="--strategy")
        info = {"kind": source.kind, "files": len(source.holder_files())}
        if source.checkpoint_id:  # the checkpoint its files record (see identity)
            info["checkpoint"] = source.checkpoint_id
        total = 0
        for n in source.names():
            shape, dt = source.info(n)
            total += shape_bytes(shape, dt)
            row = {"name": n, "shape": list(shape), "dtype": dt, "chunks": len(source.chunks(n))}
            if isinstance(source, RankSource):
                p = source.layout(n)
                row.update(
                    dev_matrix=list(p.dev_matrix), tensor_map=[list(a) for a in p.tensor_map]
                )
            rows.append(row)
        info["total_bytes"] = total
    if args.json:
        print(json.dumps({**info, "params": rows}, indent=1))
        return 0
    print("  ".join(f"{k}={v}" for k, v in info.items()))
    for r in rows:
        extra = {k: v for k, v in r.items() if k not in ("name",) and v not in (None, [], 0)}
        print(f"  {r['name']}: " + " ".join(f"{k}={v}" for k, v in extra.items()))
    return 0
