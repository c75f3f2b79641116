"""The `tessel` command line: build, inspect, run, generate, serve, demo, ckpt."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from dataclasses import replace

from tessel.checkpoint import cli as ckpt_cli
from tessel.config.errors import ConfigError
from tessel.config.sampling import SAMPLING_FIELDS, SAMPLING_SETTINGS
from tessel.errors import TesselError


def _build(args: argparse.Namespace) -> int:
    from tessel.builder import build
    from tessel.builder.options import check_build_options
    from tessel.capture import load_model_spec
    from tessel.config.cluster import local_cluster, read_cluster_config

    opts = check_build_options(
        distributed_cluster_build=args.distributed_cluster_build,
        enable_graph_parallel=args.enable_graph_parallel,
        cluster_config=args.cluster_config,
        graph_parallel_option_path=args.graph_parallel_option_path,
        framework=args.framework,
        soc_version=args.soc_version,
        shard_model_dir=args.shard_model_dir,
        model_relation_config=args.model_relation_config,
    )
    if opts.cluster_config:
        cluster = read_cluster_config(opts.cluster_config, opts.soc_version)
    else:
        cluster = local_cluster(4 if opts.distributed_cluster_build else 1, opts.soc_version)
    if opts.shard_model_dir:
        from tessel.builder.slices import build_from_slices

        if opts.framework != "pytorch" or args.input_shape:
            raise ConfigError(
                "command line",
                "--framework" if opts.framework != "pytorch" else "--input_shape",
                "is not used with --shard_model_dir (the slices are .pt2 files, --framework=pytorch)",
            )
        if args.model:
            raise ConfigError(
                "command line", "--model", "is not used with --shard_model_dir (the slices are)"
            )
        built = build_from_slices(
            opts.shard_model_dir, opts.model_relation_config, cluster, opts.soc_version
        )
        return _saved(built, args.output)
    if not args.model:
        raise ConfigError(
            "command line",
            "--model",
            "is required: a .pt2 file or file.py:function, an .onnx file with --framework=5 "
            "(or --shard_model_dir for slices)",
        )
    if opts.framework == "onnx" and args.weights:
        raise ConfigError(
            "command line",
            "--weights",
            "streams a PyTorch model's weights from a checkpoint; an ONNX file holds its own",
        )
    generation = _generation(args, opts.framework)
    model, example_inputs, optimizer = load_model_spec(
        args.model, opts.framework, None if generation else args.input_shape
    )
    graph_parallel = opts.enable_graph_parallel
    if generation is not None:
        _check_generation_build(optimizer, graph_parallel, cluster.world_size)
        graph_parallel = True  # one device, or the flag already 1
    if args.param_dtype and optimizer is None:
        raise ConfigError(
            "command line",
            "--param_dtype",
            "sets a training step's compute dtype; the --model function returned no optimizer",
        )
    built = build(
        model,
        example_inputs,
        optimizer=optimizer,
        param_dtype=args.param_dtype,
        cluster=cluster,
        policy=opts.graph_parallel_option_path,
        soc_version=opts.soc_version,
        graph_parallel=graph_parallel,
        reuse_layers=not args.trace_every_layer,
        verify=args.verify,
        weights=args.weights,
        generation=generation,
    )
    return _saved(built, args.output)


def _generation(args: argparse.Namespace, framework: str):
    """The `Generation` ATC's gear flags ask for (and `--row_prefill`), or None where none is
    given."""
    if args.max_seq_len is None and not args.dynamic_dims:
        if args.row_prefill:
            raise ConfigError(
                "command line",
                "--row_prefill",
                "adds gears to a generation build; give --max_seq_len and the gears' flags too",
            )
        return None
    from tessel.config.generation import generation_from_flags

    if framework != "pytorch" or args.model.endswith((".pt2", ".onnx")):
        raise ConfigError(
            "command line",
            "--model",
            "a generation build (--max_seq_len, --dynamic_dims) captures a transformers "
            "causal LM from file.py:function, found "
            + (f"--framework={args.framework}" if framework != "pytorch" else args.model),
        )
    generation = generation_from_flags(args.input_shape, args.dynamic_dims, args.max_seq_len)
    return replace(generation, row_prefill=args.row_prefill)


def _check_generation_build(optimizer, graph_parallel: bool, devices: int) -> None:
    if optimizer is not None:
        raise ConfigError(
            "command line",
            "--max_seq_len",
            "builds generation gears; the --model function returned an optimizer (a training step)",
        )
    if not graph_parallel and devices > 1:
        raise ConfigError(
            "command line",
            "--enable_graph_parallel",
            f"must be 1 for a generation build over {devices} devices: the gears are "
            "partitioned (replicas of whole gears are not built)",
        )


def _saved(built, output: str) -> int:
    """Write the package; print the plan at --log=info, its summary at the default level."""
    from tessel.report import format_plan
    from tessel.summary import build_summary

    path = built.save(output)
    if logging.getLogger().isEnabledFor(logging.INFO):
        print(format_plan(built.manifest))
    elif logging.getLogger().isEnabledFor(logging.WARNING):
        print(build_summary(built.manifest, str(path)))
    print(f"wrote {path}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    # reads the manifest alone: no torch unless --verify reads the members
    from tessel.package import Package
    from tessel.report import format_plan, inspect_json

    package = Package.open(args.model)
    if args.verify:
        package.verify()
    if args.html:
        from tessel.plan_page import write_page

        print(f"wrote {write_page(package.manifest, args.html)}")
    elif args.json:
        print(json.dumps(inspect_json(package.manifest), indent=1))
    else:
        print(format_plan(package.manifest))
    return 0


def _run(args: argparse.Namespace) -> int:
    from tessel.runtime.cli_run import run_command

    return run_command(args)


def _generate(args: argparse.Namespace) -> int:
    from tessel.runtime.cli_run import generate_command

    return generate_command(args)


def _serve(args: argparse.Namespace) -> int:
    from tessel.serving.server import serve_command

    return serve_command(args)


def _demo(args: argparse.Namespace) -> int:
    from tessel.demo import run_demo

    return run_demo(args.devices, args.layers)


def _switch(flag: str):
    """An ATC-style 0/1 flag value."""

    def parse(value: str) -> bool:
        if value not in ("0", "1"):
            raise ConfigError(flag, None, f"expected 0 or 1, found {value!r}")
        return value == "1"

    return parse


def _positive(flag: str):
    """A positive int flag value."""

    def parse(value: str) -> int:
        if not (value.isascii() and value.isdigit() and int(value) > 0):
            raise ConfigError(flag, None, f"expected a positive int, found {value!r}")
        return int(value)

    return parse


def _count(flag: str):
    """An int flag value of 0 or more."""

    def parse(value: str) -> int:
        if not (value.isascii() and value.isdigit()):
            raise ConfigError(flag, None, f"expected an int of 0 or more, found {value!r}")
        return int(value)

    return parse


def _port(value: str) -> int:
    """A TCP port, 0 for a free one."""
    if not (value.isascii() and value.isdigit() and int(value) <= 65535):
        raise ConfigError("--port", None, f"expected a port from 0 to 65535, found {value!r}")
    return int(value)


def _seconds(flag: str):
    """A positive number of seconds."""

    def parse(value: str) -> float:
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not 0 < seconds < math.inf:
            raise ConfigError(flag, None, f"expected a positive number of seconds, found {value!r}")
        return seconds

    return parse


def _serve_flags(s: argparse.ArgumentParser) -> None:
    """`tessel serve`'s flags: the node, and how the head serves HTTP. The HTTP flags' defaults
    are None (told in their help), so a node that is not the head can refuse them by name."""
    from tessel.serving.server import (
        DEFAULT_DRAIN_TIMEOUT,
        DEFAULT_HOST,
        DEFAULT_MAX_BODY_BYTES,
        DEFAULT_MAX_QUEUED_REQUESTS,
        DEFAULT_PORT,
    )

    s.add_argument("model", help="a .tessel offline model; the head serves one with generation")
    s.add_argument(
        "--node-id",
        type=int,
        default=None,
        help="the cluster node this host is (default: the head, which serves HTTP; the "
        "head's id serves HTTP where an HTTP flag is given too; a node's id alone starts that "
        "node's workers and waits for the head)",
    )
    h = s.add_argument_group("HTTP, on the head")
    h.add_argument(
        "--host",
        help=f"the address to listen at; 0.0.0.0 for every interface (default: {DEFAULT_HOST})",
    )
    h.add_argument(
        "--port",
        type=_port,
        help="the port to listen at, not the cluster's own; 0: a free one, printed when the "
        f"server is ready (default: {DEFAULT_PORT})",
    )
    h.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a saved Hugging Face tokenizer: text prompts, chat (its chat template), text "
        "answers and stop strings (default: none; prompts are token ids)",
    )
    h.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model's name in requests and /v1/models (default: the package file's stem)",
    )
    h.add_argument(
        "--api-key",
        metavar="KEY",
        help="answer /v1/ only to requests bearing this key (Authorization: Bearer KEY) "
        "(default: none, every request)",
    )
    h.add_argument(
        "--max-queued-requests",
        type=_count("--max-queued-requests"),
        metavar="N",
        help="requests that may wait beyond the free slots; more are answered 429 "
        f"(default: {DEFAULT_MAX_QUEUED_REQUESTS})",
    )
    h.add_argument(
        "--queue-timeout",
        type=_seconds("--queue-timeout"),
        metavar="SECONDS",
        help="a request waiting this long for a slot is answered 503 (default: none; it waits)",
    )
    h.add_argument(
        "--max-body-bytes",
        type=_positive("--max-body-bytes"),
        metavar="BYTES",
        help=f"larger request bodies are answered 413 (default: {DEFAULT_MAX_BODY_BYTES}, 1 MiB)",
    )
    h.add_argument(
        "--drain-timeout",
        type=_seconds("--drain-timeout"),
        metavar="SECONDS",
        help="on SIGTERM, how long open requests may still run before they are ended and the "
        f"server exits (default: {DEFAULT_DRAIN_TIMEOUT:g})",
    )


def _node_id_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--node-id",
        type=int,
        default=None,
        help="the cluster node this host is (default: the head node)",
    )


# a flag spelled otherwise than its setting: one id a flag, repeated for several
_FLAG_SPELLINGS = {"suppress_tokens": "--suppress-token"}


def _sampling_flags(parser: argparse.ArgumentParser) -> None:
    """`tessel generate`'s decoding flags: one per `Sampling` field (`--min-length` for
    `min_length`), its type and help from `SAMPLING_FIELDS`, its dest the field's name, so
    the parsed settings go to `Session.generate` as they are. Each flag's default is None,
    not asked: the model's setting, else `transformers`' default, as in `Session.generate`."""
    for setting in SAMPLING_FIELDS:
        flag = _FLAG_SPELLINGS.get(setting.name, "--" + setting.name.replace("_", "-"))
        told = setting.help.replace("%", "%%")  # argparse formats help with %
        if setting.several:
            told += " One id a flag, again for each of several."
        if setting.name in SAMPLING_SETTINGS:
            told += " (default: the model's generation_config, else transformers')"
        else:
            told += f" (default: {setting.default})"
        if setting.kind is bool:
            parser.add_argument(
                flag, dest=setting.name, action=argparse.BooleanOptionalAction, help=told
            )
            continue
        parser.add_argument(
            flag,
            dest=setting.name,
            type=setting.kind,
            action="append" if setting.several else "store",
            metavar="TOKEN_ID" if setting.several or setting.name.endswith("token_id") else None,
            help=told,
        )


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessel",
        description="Build, partition and deploy PyTorch models across many devices.",
    )
    parser.add_argument(
        "--log",
        default="warning",
        help="debug|info|warning|error|null (default warning: a build prints its summary, and "
        "long phases show on a terminal; info: the whole plan; error: quiet but for errors; "
        "debug: torch's own warnings too)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    b = sub.add_parser("build", help="build one offline model for a cluster (ATC-style flags)")
    b.add_argument(
        "--model",
        help=".pt2 file from torch.export.save, or file.py:function returning (module, "
        "example_inputs), or (module, example_inputs, optimizer) to build a training step "
        "(torch.optim SGD, Adam or AdamW); with --framework=5 an .onnx file",
    )
    b.add_argument(
        "--param_dtype",
        choices=("float32", "bfloat16"),
        help="training step: compute in this dtype over fp32 master weights, optimizer states "
        "and gradient exchange (default: the dtype of the model's parameters)",
    )
    b.add_argument(
        "--framework",
        default="pytorch",
        help="the model's framework: pytorch (default), or 5 or onnx for an ONNX file (ATC's "
        "code 5; needs the onnx extra). ATC's 0 Caffe, 1 MindSpore and 3 TensorFlow are refused",
    )
    b.add_argument(
        "--input_shape",
        help='ONNX models and .pt2 files: the input shapes, "name:1,3,224,224;name2:1,16" '
        "(ATC's syntax), fixing their dynamic dimensions; every dimension a positive integer. "
        "Required where an ONNX dimension is dynamic; a .pt2 builds at its recorded shapes "
        "without it. A generation build: the prompt, input_ids:BATCH,LENGTH, each -1 set by "
        "--dynamic_dims",
    )
    b.add_argument(
        "--dynamic_dims",
        help="a generation build's gears, ATC's syntax: \"1,64;4,64;4,256\" gives each gear's "
        'values of the -1 dimensions of --input_shape="input_ids:-1,-1" in order (batch, '
        "prompt length). Each length is a prefill gear; the cache takes the largest batch (a "
        "smaller one runs in its rows). Needs --max_seq_len",
    )
    b.add_argument(
        "--max_seq_len",
        type=_positive("--max_seq_len"),
        help="builds generation gears (tessel generate): the tokens, prompt and new, each row's "
        "KV cache holds on the devices; with --input_shape=input_ids:BATCH,LENGTH and "
        "--dynamic_dims for its -1s",
    )
    b.add_argument(
        "--row_prefill",
        action="store_true",
        help="a generation build: also a one-row prefill gear per prompt length, which tessel "
        "serve admits each request with (it writes that request's cache row alone, where the "
        "other prefill gears compute every row); for caches of keys and values, on one replica "
        "of one stage",
    )
    b.add_argument(
        "--soc_version", default="cpu", help="device kind: cpu, A100, H100, H200, Ascend910B, ..."
    )
    b.add_argument("--output", required=True, help="output path; .tessel is added")
    b.add_argument("--cluster_config", help="cluster config (numa_config JSON)")
    b.add_argument(
        "--distributed_cluster_build", default="0", help="1: build for distributed deployment"
    )
    b.add_argument(
        "--enable_graph_parallel",
        default="0",
        help="1: algorithm-based partitioning (needs the two above)",
    )
    b.add_argument(
        "--graph_parallel_option_path",
        help="partitioning policy JSON (mandatory with --enable_graph_parallel=1)",
    )
    b.add_argument(
        "--shard_model_dir",
        help="directory of pre-sliced models, one .pt2 per rank with its collectives (instead of "
        "--model; needs --distributed_cluster_build=1 and --cluster_config)",
    )
    b.add_argument(
        "--model_relation_config",
        help="model_relation_config.json: each slice's device and rank, and the communication "
        "groups its collectives name (with --shard_model_dir)",
    )
    b.add_argument(
        "--weights",
        help="checkpoint directory (save_pretrained's safetensors, with or without "
        "model.safetensors.index.json) to stream each rank's weights from: the model may hold "
        "its parameters on the meta device (tessel.empty_weights())",
    )
    b.add_argument("--log", dest="sub_log", default=None, help="debug|info|warning|error|null")
    b.add_argument(
        "--trace_every_layer",
        action="store_true",
        help="trace every layer of a stack of identical layers (default: trace one, copy it)",
    )
    b.add_argument(
        "--verify",
        nargs="?",
        const="1",
        default=None,
        type=_switch("--verify"),
        help="1: run the built model on the example inputs in this process and refuse to write it "
        "unless it agrees with the eager model; it costs about three forward passes of the model "
        "on the build machine (the eager one, every device's share, the comparison). 0: skip the "
        "check. Default: check where the cost model puts that below what the build took, and "
        "say in the plan (tessel inspect) when it was skipped",
    )
    b.set_defaults(func=_build)

    i = sub.add_parser(
        "inspect", help="print the plan: placements per layer, collectives and memory per device"
    )
    i.add_argument("model", help="a .tessel offline model")
    i.add_argument("--json", action="store_true", help="print the plan as JSON")
    i.add_argument(
        "--html",
        metavar="PAGE",
        help="write the plan as one self-contained HTML page: the mesh, placements per layer, "
        "a rank x rank heat map of bytes moved, memory per device, pipeline stages",
    )
    i.add_argument("--verify", action="store_true", help="also check every member's checksum")
    i.set_defaults(func=_inspect)

    r = sub.add_parser("run", help="load an offline model on its devices and run it once")
    r.add_argument("model", help="a .tessel offline model")
    r.add_argument(
        "--inputs",
        help="safetensors with input_0, input_1, ... (default: random inputs of the recorded shapes)",
    )
    r.add_argument("--output", help="write output_0, output_1, ... to this safetensors file")
    _node_id_flag(r)
    r.add_argument(
        "--repeat", type=int, default=1, help="run this many times and print the latency"
    )
    r.set_defaults(func=_run)

    g = sub.add_parser(
        "generate", help="generate tokens from a package built with generation gears"
    )
    g.add_argument("model", help="a .tessel offline model built with --max_seq_len")
    g.add_argument(
        "--input-ids",
        help="safetensors with input_ids [rows, tokens] (int64) and, for prompts of different "
        "lengths, attention_mask (0 over each row's left padding)",
    )
    g.add_argument(
        "--tokenizer", help="a saved Hugging Face tokenizer directory: prompts in, text out"
    )
    g.add_argument(
        "--prompt", action="append", help="a prompt's text (with --tokenizer); repeat for a batch"
    )
    g.add_argument(
        "--max-new-tokens",
        type=_positive("--max-new-tokens"),
        help="how many tokens to make (default: the model's, else 20, as transformers counts)",
    )
    _sampling_flags(g)
    g.add_argument(
        "--eos-token-id",
        type=int,
        action="append",
        help="stop a row at this token; again for each of several (default: the model's)",
    )
    g.add_argument(
        "--pad-token-id", type=int, help="pad finished rows with it (default: the model's)"
    )
    g.add_argument("--stream", action="store_true", help="print the tokens as they are made")
    g.add_argument("--output", help="write sequences [rows, prompt + new] to this safetensors")
    _node_id_flag(g)
    g.set_defaults(func=_generate)

    s = sub.add_parser(
        "serve",
        help="serve a generation package over HTTP (OpenAI's routes), or start this host's "
        "workers of a model whose cluster spans several nodes",
        description="The head (no --node-id, or the head's) loads the package on its devices "
        "and answers OpenAI's /v1/completions and /v1/chat/completions, many requests at once "
        "(each a slot, a row of the package's cache), with /v1/models, /health and /metrics. "
        "A prompt holds at most the package's longest prefill gear of tokens, and a prompt "
        "and its max_tokens at most its max_seq_len (tessel inspect shows both, /v1/models "
        "too). SIGTERM stops admitting, lets open requests finish (--drain-timeout) and "
        "exits 0; a worker's death ends every request and exits 1. A node of a multi-node "
        "model (--node-id N, no HTTP flag) starts its workers and waits for the head.",
    )
    _serve_flags(s)
    s.set_defaults(func=_serve)

    d = sub.add_parser("demo", help="build and run a small Llama on a local cluster of CPU devices")
    d.add_argument("--devices", type=int, default=4)
    d.add_argument("--layers", type=int, default=4)
    d.set_defaults(func=_demo)

    ckpt_cli.register(sub)
    return parser


def _configure_logging(value: str) -> None:
    from tessel.log_levels import keep_torch_quiet, log_level

    level = log_level(value)
    logging.basicConfig(
        level=level or logging.CRITICAL + 1, format="%(levelname)s %(name)s: %(message)s"
    )
    if level is None:
        logging.disable(logging.CRITICAL)
    keep_torch_quiet(level)
    if level is None or level > logging.DEBUG:
        # the workers' torch (C++) keeps its warnings to itself: a worker still joining its
        # group when another fails warns of the reset connection, and the failure is one line
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        _configure_logging(getattr(args, "sub_log", None) or args.log)
        return int(args.func(args) or 0)
    except (TesselError, FileNotFoundError) as exc:
        print(f"tessel: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    except KeyboardInterrupt:
        print("tessel: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
