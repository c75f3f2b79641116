"""The deploy-info grammar: the example deploy file, device lists, ranges, syntax errors."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tessel.dataflow import DeployError, LogicDevice, parse_logic_device_list, read_deploy_info
from tessel.dataflow.errors import RULE_INVOKE_ONE_OF, RULE_ONCE, RULE_SYNTAX

from .conftest import write_json

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "dataflow"


def ids(text: str, keep: bool = True) -> list[str]:
    return [str(d) for d in parse_logic_device_list(text, keep_order=keep)]


def test_example_deploy_file_expands_to_the_devices_it_describes():
    info = read_deploy_info(EXAMPLES / "data_flow_deploy_info.json")
    assert info.keep_logic_device_order is False
    got = {tuple(e.nodes): [str(d) for d in e.devices] for e in info.entries}
    assert got == {
        ("flowNode1", "flowNode2"): ["0:0:-1:0"],
        ("flowNode3",): ["0:0:1:1"],
        ("flowNode4",): ["0:0:0:0", "0:0:1:0"],
        ("flowNode5", "flowNode6"): ["0:0:2:0", "0:0:2:1", "0:0:3:0", "0:0:3:1"],
        ("flowNode7", "flowNode8"): ["0:0:0:0", "0:0:1:0", "0:0:2:1"],
    }
    inv = info.entries[2].invokes
    assert set(inv) == {"invoked_flow_graph_name", "invoked_flow_graph_name1"}
    nested = inv["invoked_flow_graph_name"].nested
    assert nested is not None and nested.entries[0].nodes == ["invoked_node"]
    assert inv["invoked_flow_graph_name"].devices is None
    assert inv["invoked_flow_graph_name1"].devices == [LogicDevice(0, 0, 0, 0)]
    assert info.entries[0].devices[0].is_host


def test_range_is_a_cartesian_product():
    assert ids("0:0:0~1:0~1") == ["0:0:0:0", "0:0:0:1", "0:0:1:0", "0:0:1:1"]
    assert len(ids("0:0~1:0~2:0~3")) == 2 * 3 * 4


def test_three_parts_mean_numa_zero_and_lists_keep_or_sort_order():
    assert ids("0:0:3") == ["0:0:3:0"]
    assert ids("0:0:2:0,0:0:0:1") == ["0:0:2:0", "0:0:0:1"]
    assert ids("0:0:2:0,0:0:0:1", keep=False) == ["0:0:0:1", "0:0:2:0"]
    assert ids(" 0:1:-1 ") == ["0:1:-1:0"]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "0:0",
        "0:0:0:0:0",
        "0:0:a:0",
        "0:0:3~1:0",
        "0:-1:0:0",
        "0:0:-1~2:0",
        "0:0:99999:0",
        "0:0:0:0,0:0:0:0",
        "0:0:0~300:0~300",
    ],
)
def test_bad_device_lists_are_syntax_errors(text):
    with pytest.raises(DeployError) as e:
        parse_logic_device_list(text, "f.json")
    assert e.value.rule == RULE_SYNTAX
    assert "f.json" in str(e.value)


def test_invoke_entry_takes_one_of_file_or_list(tmp_path):
    path = write_json(
        tmp_path / "d.json",
        {
            "batch_deploy_info": [
                {
                    "flow_node_list": ["a"],
                    "logic_device_list": "0:0:0:0",
                    "invoke_list": [
                        {
                            "invoke_name": "m",
                            "deploy_info_file": "x.json",
                            "logic_device_list": "0:0:0",
                        }
                    ],
                }
            ]
        },
    )
    with pytest.raises(DeployError) as e:
        read_deploy_info(path)
    assert e.value.rule == RULE_INVOKE_ONE_OF
    assert "d.json" in str(e.value) and "'m'" in str(e.value)


def test_node_listed_twice_in_the_file(tmp_path):
    path = write_json(
        tmp_path / "d.json",
        {
            "batch_deploy_info": [
                {"flow_node_list": ["a", "b"], "logic_device_list": "0:0:0:0"},
                {"flow_node_list": ["b"], "logic_device_list": "0:0:1:0"},
            ]
        },
    )
    with pytest.raises(DeployError) as e:
        read_deploy_info(path)
    assert e.value.rule == RULE_ONCE and e.value.node == "b"
    assert "batch_deploy_info[1]" in str(e.value)


def test_legacy_deploy_info_comments_and_unknown_keys(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(
        '{ // legacy form\n "deploy_info": [{"flow_node_name": "a", "logic_device_id": "0:0:1"},],}'
    )
    info = read_deploy_info(p)
    assert [str(d) for d in info.entries[0].devices] == ["0:0:1:0"]
    bad = write_json(tmp_path / "e.json", {"batch_deploy_info": [], "surprise": 1})
    with pytest.raises(DeployError, match="unknown key"):
        read_deploy_info(bad)
    with pytest.raises(DeployError, match="file not found"):
        read_deploy_info(tmp_path / "missing.json")


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3)), min_size=3, max_size=4),
        min_size=1,
        max_size=3,
    )
)
def test_expansion_is_the_product_of_the_ranges(items):
    texts, expected = [], set()
    for parts in items:
        ranges = [range(lo, lo + n + 1) for lo, n in parts]
        texts.append(
            ":".join(f"{r.start}~{r.stop - 1}" if len(r) > 1 else str(r.start) for r in ranges)
        )
        if len(ranges) == 3:
            ranges.append(range(1))
        expected |= set(itertools.product(*ranges))
    total = sum(len(list(itertools.product(*[range(n + 1) for _, n in p]))) for p in items)
    text = ",".join(texts)
    if total != len(expected):  # overlapping items list a device twice: an error
        with pytest.raises(DeployError, match="twice"):
            parse_logic_device_list(text)
        return
    got = parse_logic_device_list(text, keep_order=False)
    assert {(d.cluster, d.server, d.device, d.numa) for d in got} == expected
    assert got == sorted(got) and len(got) == total


def _entry(**changes) -> dict:
    return {"flow_node_list": ["a"], "logic_device_list": "0:0:0:0", **changes}


@pytest.mark.parametrize(
    "data, key, words",
    [
        (
            {"batch_deploy_info": [_entry(logic_device_list="0:0:\u0663:0")]},
            "batch_deploy_info[0].logic_device_list",
            "part '\u0663' is not N or N~M",
        ),
        (
            {"batch_deploy_info": [_entry(flow_node_lst=["b"])]},
            "batch_deploy_info[0].flow_node_lst",
            "did you mean 'flow_node_list'?",
        ),
        (
            {"batch_deploy_info": [_entry()], "keep_logic_device_order": "true"},
            "keep_logic_device_order",
            "expected a boolean, found string 'true'",
        ),
        (
            {"batch_deploy_info": [_entry(flow_node_list=["a", ""])]},
            "batch_deploy_info[0].flow_node_list[1]",
            "expected a non-empty string",
        ),
        (
            {"batch_deploy_info": [_entry(flow_node_list=["a", "a"])]},
            "batch_deploy_info[0].flow_node_list[1]",
            "is listed again (first at batch_deploy_info[0].flow_node_list[0])",
        ),
        (
            {
                "batch_deploy_info": [
                    _entry(invoke_list=[{"invoke_name": "m", "deploy_info_file": "x\x00.json"}])
                ]
            },
            "batch_deploy_info[0].invoke_list[0].deploy_info_file",
            "control characters (such as NUL) are not allowed",
        ),
        (
            {
                "batch_deploy_info": [
                    _entry(invoke_list=[{"invoke_name": "m", "deploy_info_file": "x" * 300}])
                ]
            },
            "invoke_list[0].deploy_info_file",
            "File name too long",
        ),
        ({"batch_deploy_info": []}, "", "places no node"),
        (
            {"deploy_info": [{"flow_node_name": "a", "logic_device": "0:0:0"}]},
            "deploy_info[0].logic_device",
            "did you mean 'logic_device_id'?",
        ),
    ],
)
def test_deploy_info_refuses_nonsense(tmp_path, data, key, words):
    path = write_json(tmp_path / "d.json", data)
    with pytest.raises(DeployError) as e:
        read_deploy_info(path)
    assert e.value.rule in (RULE_SYNTAX, RULE_ONCE)
    assert key in str(e.value) and words in str(e.value) and "\n" not in str(e.value)


def test_real_cann_deploy_files_keep_loading(tmp_path):
    # the shape of hicann/ge's examples/dflow/cpp/config/data_flow_deploy_info.json
    path = write_json(
        tmp_path / "d.json",
        {
            "dynamic_schedule_enable": True,
            "batch_deploy_info": [
                {"flow_node_list": ["node0"], "logic_device_list": "0:0:0:0"},
                {"flow_node_list": ["node1"], "logic_device_list": "0:0:0:0"},
                {"flow_node_list": ["node2"], "logic_device_list": "0:0:1~2:0"},
            ],
        },
    )
    info = read_deploy_info(path)
    assert info.dynamic_schedule_enable and len(info.entries[2].devices) == 2
