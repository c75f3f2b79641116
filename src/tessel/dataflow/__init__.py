"""DataFlow for PyTorch: graphs of UDF and model nodes, placed on devices, run with many instances.

import tessel.dataflow as df
df.init({})
x = df.FlowData()
out = add_one.fnode()(x)          # add_one decorated with @df.pyflow
g = df.FlowGraph([out])
g.feed({x: 1}); print(g.fetch())  # ([2], 0)
df.finalize()
"""

from tessel.dataflow import utils
from tessel.dataflow.deploy import (
    DEPLOY_INFO_OPTION,
    DeployInfo,
    LogicDevice,
    parse_logic_device_list,
    read_deploy_info,
)
from tessel.dataflow.errors import DeployError, FlowTimeout, TransactionFailed
from tessel.dataflow.flow_info import FlowFlag, FlowInfo
from tessel.dataflow.graph import FAILED, SUCCESS, FlowGraph
from tessel.dataflow.node_runtime import (
    MetaParams,
    RunContext,
    get_run_context,
    get_running_device_id,
    get_running_instance_id,
    get_running_instance_num,
)
from tessel.dataflow.nodes import FlowData, FlowNode, FlowOutput
from tessel.dataflow.process_points import (
    FlowGraphProcessPoint,
    Framework,
    FuncProcessPoint,
    GraphProcessPoint,
)
from tessel.dataflow.pyflow import method, pyflow
from tessel.dataflow.session import finalize, init

__all__ = [
    "DEPLOY_INFO_OPTION",
    "FAILED",
    "SUCCESS",
    "DeployError",
    "DeployInfo",
    "FlowData",
    "FlowFlag",
    "FlowGraph",
    "FlowGraphProcessPoint",
    "FlowInfo",
    "FlowNode",
    "FlowOutput",
    "FlowTimeout",
    "Framework",
    "FuncProcessPoint",
    "GraphProcessPoint",
    "LogicDevice",
    "MetaParams",
    "RunContext",
    "TransactionFailed",
    "finalize",
    "get_run_context",
    "get_running_device_id",
    "get_running_instance_id",
    "get_running_instance_num",
    "init",
    "method",
    "parse_logic_device_list",
    "pyflow",
    "read_deploy_info",
    "utils",
]
