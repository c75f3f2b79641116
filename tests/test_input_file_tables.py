"""The key tables of docs/reference/input-files.md are the readers' own: each file is read with
every object its reader checks present, the keys each check accepts are recorded, and the
table must list exactly those (a key accepted and undocumented, or documented and refused,
fails here)."""

from __future__ import annotations

import json
import re

import pytest
from tests.conftest import ROOT
from tests.test_hostile_files import RELATION

from tessel.config import fields
from tessel.config.cluster import cluster_from_dict
from tessel.config.parallel_option import parallel_option_from_dict
from tessel.dataflow.deploy import parse_deploy_info
from tessel.slices.relation import read_model_relation

PAGE = ROOT / "docs" / "reference" / "input-files.md"


def _accepted(read, monkeypatch, extra: tuple[str, ...] = ()) -> set[str]:
    """The key paths (list indices dropped) that `read()`'s checks accept (with `extra`
    accepted beside them at every level)."""
    seen: set[str] = set()
    check = fields.Fields.check_keys

    def spy(self, allowed, not_built=None):
        allowed = (*allowed, *extra)
        prefix = re.sub(r"\[\d+\]", "[]", self.key_path)
        refused = not_built or {}  # CANN's keys tessel refuses by name
        seen.update(f"{prefix}.{k}" if prefix else k for k in allowed if k not in refused)
        return check(self, allowed, not_built)

    monkeypatch.setattr(fields.Fields, "check_keys", spy)
    read()
    return seen


def _table(heading: str) -> set[str]:
    """The first column's key paths of the table under `heading`."""
    section = PAGE.read_text().partition(f"\n## {heading}\n")[2].partition("\n## ")[0]
    return set(re.findall(r"^\| `([\w.\[\]]+)` \|", section, re.M))


# every object the policy's reader checks, each with one key it takes
EVERY_POLICY_OBJECT = {
    "graph_parallel_option": {
        "auto": False,
        "tensor_parallel_option": {"tensor_parallel_size": 2},
        "data_parallel_option": {"data_parallel_size": 1},
        "pipeline_parallel_option": {"pipe_stage_num": 1},
        "tensor_sharding": {"optimizer_state_sharding": True},
        "optimizer_offload_option": {"offload": "cpu"},
    }
}


# every object the cluster config's reader checks, every key of each given
EVERY_CLUSTER_OBJECT = {
    "cluster": [{
        "cluster_nodes": [{
            "node_id": 0, "node_type": "ATLAS800", "ipaddr": "127.0.0.1", "port": 2509,
            "memory": 64, "is_local": True, "auth_lib_path": "/opt/auth",
            "deploy_res_path": "/opt/deploy", "data_panel": {"avail_ports": ["16666~32767"]},
            "item_list": [{"item_id": 0, "device_id": 0, "ipaddr": "10.0.0.1", "plane_id": 0},
                          {"item_id": 1, "device_id": 1}],
        }],
        "nodes_topology": {"type": "star", "protocol": "RDMA:200Gb",
                           "topos": [{"plane_id": 0, "devices": [0, 1]}]},
    }],
    "item_def": [{"item_type": "cpu", "memory": "[DDR:64GB]", "aic_type": "[DAVINCI_V100:32]",
                  "resource_type": "Ascend", "links_mode": "HCCS:128Gb",
                  "device_list": [{"device_id": 0}]}],
    "node_def": [{"node_type": "ATLAS800", "resource_type": "X86",
                  "support_links": "[HCCS,PCIE,ROCE]", "item_type": "cpu",
                  "inter_item_memory_access_mode": "[NUMA]", "h2d_bw": "PCIE:32Gb",
                  "item": [{"item_type": "cpu"}],
                  "item_topology": [{"links_mode": "HCCS:128Gb",
                                     "links": [{"item_id": 0, "pair_item_id": 1}]}]}],
}  # fmt: skip


# every object the deploy info's reader checks (the older form's entries beside the newer)
EVERY_DEPLOY_OBJECT = {
    "keep_logic_device_order": False,
    "dynamic_schedule_enable": False,
    "batch_deploy_info": [
        {
            "flow_node_list": ["a", "b"],
            "logic_device_list": "0:0:0:0",
            "invoke_list": [{"invoke_name": "sub", "logic_device_list": "0:0:1:0"}],
        }
    ],
    "deploy_info": [{"flow_node_name": "c", "logic_device_id": "0:0:1:0"}],
}


def _read_every_object(heading: str, tmp_path) -> None:
    """Read the file of `heading`'s table holding every object its reader checks."""
    if heading == "Cluster config":
        cluster_from_dict(EVERY_CLUSTER_OBJECT, "every.json")
    elif heading == "Policy":
        parallel_option_from_dict(EVERY_POLICY_OBJECT, "policy.json", 2)
    elif heading == "Deploy info":
        parse_deploy_info(EVERY_DEPLOY_OBJECT, "deploy.json")
    else:
        path = tmp_path / "model_relation_config.json"
        path.write_text(json.dumps(RELATION))  # it holds every object of the format
        read_model_relation(path)


# each table, and a key deep in its file that shows the reader reached every object
TABLES = {
    "Cluster config": "node_def[].item_topology[].links[].pair_item_id",
    "Policy": "graph_parallel_option.tensor_sharding.gradient_sharding",
    "Deploy info": "batch_deploy_info[].invoke_list[].invoke_name",
    "Model relation config": "comm_group[].group_rank_list",
}


@pytest.mark.parametrize("heading", list(TABLES))
def test_the_table_is_the_readers_keys(heading, monkeypatch, tmp_path) -> None:
    accepted = _accepted(lambda: _read_every_object(heading, tmp_path), monkeypatch)
    assert TABLES[heading] in accepted  # reached
    documented = _table(heading)
    assert accepted - documented == set(), "accepted by the reader, not in the table"
    assert documented - accepted == set(), "in the table, not accepted by the reader"


def test_a_key_missing_from_the_table_fails(monkeypatch, tmp_path) -> None:
    """The comparison sees a key the reader would accept and the table lacks."""
    accepted = _accepted(
        lambda: _read_every_object("Policy", tmp_path), monkeypatch, extra=("brand_new",)
    )
    assert "graph_parallel_option.brand_new" in accepted - _table("Policy")


@pytest.mark.parametrize("heading", list(TABLES))
def test_every_row_names_its_type_and_default(heading) -> None:
    section = PAGE.read_text().partition(f"\n## {heading}\n")[2].partition("\n## ")[0]
    rows = [r for r in section.splitlines() if r.startswith("| `")]
    assert rows
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 5 and cells[1] and cells[2] and cells[4], row
