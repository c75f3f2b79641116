"""Errors of the dataflow package: bad deployments, failed transactions."""

from __future__ import annotations

from tessel.config.errors import ConfigError
from tessel.errors import TesselError


class DeployError(ConfigError):
    """A deploy-info file, or the placement it describes, breaks one of DataFlow's rules.

    `rule` names the rule broken, `node` the flow node it concerns (None when it is about the file).
    """

    def __init__(
        self, source: object, key: str | None, rule: str, message: str, node: str | None = None
    ):
        self.rule = rule
        self.node = node
        who = f"node {node!r}: " if node else ""
        super().__init__(
            None if source is None else str(source), key, f"{who}{message} [rule: {rule}]"
        )


class TransactionFailed(TesselError, RuntimeError):
    """A fed transaction did not complete: which node (and instance) failed it and why."""

    def __init__(self, transaction_id: int, node: str, instance: int, error: str, tb: str = ""):
        self.transaction_id = transaction_id
        self.node = node
        self.instance = instance
        self.error = error
        self.traceback = tb
        super().__init__(
            f"transaction {transaction_id} failed in node {node!r} (instance {instance}): {error}"
        )


class FlowTimeout(TesselError, TimeoutError):
    """feed/fetch waited longer than its timeout (ms)."""


# The placement rules a deploy file must keep, one name each: errors carry them and tests match
# on them.
RULE_ALL_PLACED = "every node must be placed"
RULE_ONCE = "a node may be placed only once"
RULE_IN_CLUSTER = "the device must be in the cluster config"
RULE_CAN_RUN = "a node must be placed where it can run"
RULE_HOST_AND_DEVICE = "a node cannot be on both host and device"
RULE_NESTED_PARENT = "the parent of a nested graph cannot have several instances"
RULE_NESTED_INLINE = (
    "a nested graph runs in the process of the UDF that invokes it; its nodes must be placed on "
    "that UDF's device with one instance"
)
RULE_INVOKED_COUNT = "an invoked model needs as many instances as its parent"
RULE_INVOKE_ONE_OF = "an invoke_list entry takes deploy_info_file or logic_device_list, not both"
RULE_ONE_SESSION = (
    "a partitioned model runs as one instance, its ranks on the devices of its own cluster config"
)
RULE_SYNTAX = "deploy-info syntax"
RULE_UNKNOWN_NODE = "flow_node_list may only name nodes of the graph"
