"""Fuzz the four input formats: every mutation of an example file either loads as a valid
config or raises that format's own error, with a one-line message; never a raw exception.

The formats: the cluster config (numa_config), the partitioning policy, the checkpoint strategy
file (tessel's and MindSpore's JSON) and DataFlow's deploy info. Mutations work on the parsed
document (delete, misspell or duplicate keys and items, replace values with values of other
types, out-of-range numbers, unicode digits, NUL bytes, nested garbage) and on the text itself.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.json_edits import json_paths

from tessel.checkpoint.strategy import FORMAT_NAME, load_strategy
from tessel.config import ConfigError, load_json, read_cluster_config, read_parallel_option
from tessel.config.fields import is_hostname, is_ip
from tessel.dataflow import DeployError, read_deploy_info
from tessel.parallel import StrategyError

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
DEPLOY_EXAMPLES = ROOT / "examples" / "dataflow"

# Derandomized so CI runs the same cases every time; no example database, no deadline.
FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=400,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ---------------------------------------------------------------------------------------------
# the example documents


TESSEL_STRATEGY = {
    "format": FORMAT_NAME,
    "version": 1,
    "stage_device_num": 4,
    "world_size": 8,
    "params": {
        "w": {
            "shape": [8, 4],
            "dtype": "float32",
            "dev_matrix": [2, 2],
            "tensor_map": [[0, 1], []],
            "stages": [0, 1],
            "opt_shard_size": 0,
            "opt_shard_step": 0,
        },
        "v": {
            "shape": [8, 4],
            "dtype": "bfloat16",
            "dev_matrix": [2, 2],
            "tensor_map": [[], [0]],
            "stages": [1],
            "opt_shard_size": 2,
            "opt_shard_step": 2,
            "rank_list": [7, 6, 5, 4],
            "alias_name": ["dp", "tp"],
        },
    },
}
MINDSPORE_STRATEGY = {
    "current_stage": 1,
    "parallel_strategy_item": {"MatMul-op0": {"stage": 0, "parallel_strategy": [[2, 1], [1, 4]]}},
    "parallel_layout_item": {
        "w": {
            "dev_matrix": [2, 4],
            "tensor_map": [1, -1],
            "tensor_shape": [8, 4],
            "field": 0,
            "opt_weight_shard_step": 0,
            "opt_weight_shard_size": 0,
        },
        "1-b": {
            "dev_matrix": [2, 4],
            "tensor_map": [-1],
            "tensor_shape": [16],
            "field": 0,
            "opt_weight_shard_step": 4,
            "opt_weight_shard_size": 2,
        },
    },
}


def _examples(*paths: Path) -> list[dict]:
    return [load_json(p) for p in paths]


CLUSTERS = _examples(
    ROOT / "examples" / "cluster_4p.json",
    DATA / "numa_config_a2.json",
    DATA / "numa_config_inference.json",
    DATA / "numa_config_2server.json",
    DATA / "numa_config_torchair.json",
)
POLICIES = _examples(
    ROOT / "examples" / "parallel_option.json", DATA / "parallel_option_semi_auto.json"
)
POLICIES.append({"graph_parallel_option": {"auto": True}})
POLICIES.append(
    {
        "graph_parallel_option": {
            "auto": False,
            "opt_level": "O2",
            "tensor_parallel_option": {"tensor_parallel_size": 4},
            "tensor_sharding": {
                "optimizer_state_sharding": False,
                "gradient_sharding": False,
                "model_weight_sharding": False,
                "model_weight_prefetch": False,
                "model_weight_prefetch_buffer_size": 50,
            },
        }
    }
)
STRATEGIES = [TESSEL_STRATEGY, MINDSPORE_STRATEGY]
DEPLOYS = _examples(
    DEPLOY_EXAMPLES / "data_flow_deploy_info.json", DEPLOY_EXAMPLES / "pipeline_deploy_info.json"
)
DEPLOYS.append(
    {
        "dynamic_schedule_enable": True,
        "deploy_info": [{"flow_node_name": "a", "logic_device_id": "0:0:1"}],
        "batch_deploy_info": [
            {
                "flow_node_list": "b, c",
                "logic_device_list": "0:0:0:0",
                "redundant_logic_device_list": "0:0:1:0",
            }
        ],
    }
)


# ---------------------------------------------------------------------------------------------
# mutations

# Values that trip readers: wrong types, huge and negative numbers, NaN, unicode digits, NUL
# bytes, memory sizes and links of zero or 400 digits, device ids out of range.
SPECIALS: list[Any] = [
    None,
    True,
    False,
    0,
    1,
    -1,
    2**31,
    2**63,
    -(2**63),
    10**20,
    1.5,
    2.0,
    float("nan"),
    float("inf"),
    "",
    " ",
    "0",
    "-1",
    "1e400",
    "NaN",
    "not an ip",
    "\u0663",  # ARABIC-INDIC DIGIT THREE: str.isdigit() says yes
    "\uff13",  # FULLWIDTH DIGIT THREE
    "a\x00b",
    "line\nbreak",
    "x" * 300,
    "[DDR:0GB]",
    "[DDR:" + "9" * 400 + "GB]",
    "HCCS:0Gb",
    "RDMA:1e9Gb",
    "0:0:\u0663:0",
    "0:0:0~65535:0~65535",
    "0:0:-1:0",
    "O1",
    "star",
    "float13",
    [],
    {},
    [[]],
    [None],
    {"": None},
]
_JSON = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=8),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
GARBAGE = st.one_of(st.sampled_from(SPECIALS), _JSON)
# Near misses are the likeliest to slip through, so perturb weighs most.
OPS = (
    ("perturb",) * 4 + ("replace",) * 2 + ("delete", "rename", "duplicate", "empty", "swap", "nest")
)


def _at(doc: Any, loc: tuple) -> Any:
    for k in loc:
        doc = doc[k]
    return doc


def _typo(draw: st.DrawFn, word: str) -> str:
    """A misspelling: a character dropped, doubled, swapped with the next, or replaced."""
    if not word:
        return "x"
    i = draw(st.integers(0, len(word) - 1))
    kind = draw(st.sampled_from(("drop", "double", "swap", "replace")))
    if kind == "drop":
        return word[:i] + word[i + 1 :] or "x"
    if kind == "double":
        return word[:i] + word[i] + word[i:]
    if kind == "swap" and i + 1 < len(word):
        return word[:i] + word[i + 1] + word[i] + word[i + 2 :]
    return word[:i] + draw(st.sampled_from("aeiou_0\u0663\x00")) + word[i + 1 :]


_DIGITS = str.maketrans(
    "0123456789", "\u0660\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669"
)
# What a number written inside a string ("[DDR:64GB]", "HCCS:128Gb", "0:0:1:0") becomes.
_NUMBERS = ("0", "00", "-1", "0.0001", "1.5", "9" * 400, "65536", "\u0663", "\uff13", "")


def _perturb(draw: st.DrawFn, value: Any) -> Any:
    """A near miss of `value`: zero, an off-by-one, a sign flip, a huge number or the same
    number as another type; for a string, a misspelling, unicode digits, a NUL byte, or its
    first number replaced (by zero, a negative, a fraction, 400 nines...)."""
    if isinstance(value, bool):
        return draw(st.sampled_from((not value, int(value), str(value).lower(), None)))
    if isinstance(value, int):
        return draw(
            st.sampled_from(
                (
                    0,
                    -1,
                    value + 1,
                    value - 1,
                    -value,
                    2**31,
                    2**63,
                    10**20,
                    65536,
                    70000,
                    str(value),
                    float(value),
                    str(value).translate(_DIGITS),
                    [value],
                )
            )
        )
    if isinstance(value, str):
        number = draw(st.sampled_from(_NUMBERS))
        return draw(
            st.sampled_from(
                (
                    _typo(draw, value),
                    re.sub(r"[0-9]+", number, value, count=1)
                    if re.search("[0-9]", value)
                    else value + number,
                    value.translate(_DIGITS),
                    value + "\x00",
                    value.upper(),
                    value.lower(),
                    "",
                    " " + value,
                )
            )
        )
    return draw(GARBAGE)


@st.composite
def mutated(draw: st.DrawFn, bases: list[Any]) -> Any:
    """One of `bases` with one to three random mutations."""
    base = draw(st.sampled_from(bases))
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 2))):
        # Mostly a leaf (a number, string or boolean): the near misses there slip through most.
        locations = json_paths(doc)
        leaves = [loc for loc in locations if not isinstance(_at(doc, loc), (dict, list))]
        loc = draw(st.sampled_from(leaves if leaves and draw(st.integers(0, 3)) else locations))
        op = draw(st.sampled_from(OPS))
        value = _at(doc, loc)
        if op == "swap":  # a valid value from elsewhere in the file, in the wrong place
            new = copy.deepcopy(_at(base, draw(st.sampled_from(json_paths(base)))))
        elif op == "perturb":
            new = _perturb(draw, value)
        elif op == "empty" and isinstance(value, (list, dict)):
            new = type(value)()
        elif op == "nest":
            new = draw(st.sampled_from(([value], {"x": value}, [value, value])))
        elif op == "duplicate" and isinstance(value, list) and value:
            new = [*value, copy.deepcopy(draw(st.sampled_from(value)))]
        else:
            new = draw(GARBAGE)
        new = copy.deepcopy(new)  # never share (and later mutate) a drawn constant
        if not loc:
            doc = new
            continue
        parent, key = _at(doc, loc[:-1]), loc[-1]
        if op == "delete":
            del parent[key]
        elif op == "rename" and isinstance(parent, dict):
            name = draw(st.one_of(st.just(_typo(draw, key)), st.text(max_size=8)))
            parent[name] = parent.pop(key)
        else:
            parent[key] = new
    return doc


@st.composite
def mutated_text(draw: st.DrawFn, bases: list[Any]) -> str:
    """The JSON text of one of `bases` with a few characters dropped, doubled or replaced, or a
    piece of it replaced by a number too long to convert or by deep nesting."""
    text = json.dumps(draw(st.sampled_from(bases)), indent=1)
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(text) - 1))
        j = min(len(text), i + draw(st.integers(0, 8)))
        piece = draw(
            st.one_of(
                st.text(max_size=4),
                st.sampled_from(("", "9" * 5000, "[" * 100_000, ",", "}", '"', "\\", "//", "\x00")),
            )
        )
        text = text[:i] + piece + text[j:]
    return text


# ---------------------------------------------------------------------------------------------
# running a reader on a mutation


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the mutated files are written. Deploy files name a nested file relative to
    themselves: it lies there too."""
    d = tmp_path_factory.mktemp("fuzz")
    nested = DEPLOY_EXAMPLES / "data_flow_invoke_flow_graph_deploy_info.json"
    (d / nested.name).write_text(nested.read_text())
    return d


def _write(workdir: Path, doc: Any, name: str) -> Path:
    path = workdir / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def _read(path: Path, reader: Callable[[Path], Any], error: type[Exception] = ConfigError) -> Any:
    """`reader(path)`: a result, or None when it raised `error` with a one-line message."""
    try:
        return reader(path)
    except error as exc:
        message = str(exc)
        assert "\n" not in message and "\r" not in message, message
        return None


def _check_cluster(cluster: Any) -> None:
    """What a loaded cluster guarantees."""
    assert cluster.world_size >= 1
    assert len({n.node_id for n in cluster.nodes}) == len(cluster.nodes)
    assert sum(n.is_local for n in cluster.nodes) <= 1
    for node in cluster.nodes:
        assert 0 <= node.node_id < 2**31 and 1 <= node.port <= 65535
        assert is_ip(node.ipaddr) or is_hostname(node.ipaddr)
        for d in node.devices:
            assert 0 <= d.item_id < 2**31 and 0 <= d.device_id < 2**31
            assert 1 <= d.memory_bytes <= 2**60
    for bw in (cluster.link_bandwidth, cluster.network_bandwidth):
        assert 0 < bw < math.inf


def test_the_examples_are_valid(workdir):
    """The fuzz starts from valid files: each example loads as it is (CANN's semi-auto
    example policy too, its training switches read for a training build)."""
    for doc in CLUSTERS:
        _check_cluster(read_cluster_config(_write(workdir, doc, "numa_config.json"), "Ascend910B"))
    for doc in POLICIES:
        read_parallel_option(_write(workdir, doc, "parallel_option.json"))
    for doc in STRATEGIES:
        assert load_strategy(_write(workdir, doc, "strategy.json")) is not None
    for doc in DEPLOYS:
        read_deploy_info(_write(workdir, doc, "deploy.json"))


@FUZZ
@given(doc=mutated(CLUSTERS))
def test_cluster_config_mutations(workdir, doc):
    cluster = _read(
        _write(workdir, doc, "numa_config.json"), lambda p: read_cluster_config(p, "Ascend910B")
    )
    if cluster is not None:
        _check_cluster(cluster)


@FUZZ
@given(doc=mutated(POLICIES))
def test_policy_mutations(workdir, doc):
    option = _read(_write(workdir, doc, "parallel_option.json"), read_parallel_option)
    if option is not None:
        assert isinstance(option.auto, bool) and option.opt_level in ("O2", "O1")
        assert option.optimizer_offload in (None, "cpu")
        assert option.tensor_parallel_size is None or 1 <= option.tensor_parallel_size < 2**31
        assert 0 <= option.model_weight_prefetch_buffer_size <= 2**20


@FUZZ
@given(doc=mutated(STRATEGIES))
def test_strategy_file_mutations(workdir, doc):
    strategy = _read(_write(workdir, doc, "strategy.json"), load_strategy, StrategyError)
    if strategy is not None:
        assert strategy.params and 1 <= strategy.world_size < 2**31
        for p in strategy.params.values():
            assert all(type(d) is int and d >= 1 for d in p.dev_matrix)
            assert type(p.opt_shard_size) is int and type(p.opt_shard_step) is int
            assert len(set(p.stages)) == len(p.stages)


@FUZZ
@given(doc=mutated(DEPLOYS))
def test_deploy_info_mutations(workdir, doc):
    info = _read(_write(workdir, doc, "deploy.json"), read_deploy_info, DeployError)
    if info is not None:
        names = [n for e in info.entries for n in e.nodes]
        assert names and len(set(names)) == len(names)
        assert all(e.devices for e in info.entries)


@pytest.mark.parametrize(
    "bases, name, reader, error",
    [
        (CLUSTERS, "numa_config.json", read_cluster_config, ConfigError),
        (POLICIES, "parallel_option.json", read_parallel_option, ConfigError),
        (STRATEGIES, "strategy.json", load_strategy, StrategyError),
        (DEPLOYS, "deploy.json", read_deploy_info, DeployError),
    ],
    ids=["cluster", "policy", "strategy", "deploy"],
)
def test_text_mutations(workdir, bases, name, reader, error):
    @settings(FUZZ, max_examples=150)
    @given(mutated_text(bases))
    def check(text):
        _read(_write(workdir, text, name), reader, error)

    check()
