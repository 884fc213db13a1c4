"""Inventory: where the nodes come from. Static nodes are written in the topology; node groups are discovered (EC2).

A node group is a selection (DescribeInstances filters) plus the layout of instances to put on every machine it
selects. Discovery yields `Machine`s; `expand_groups` (pure) turns them into ordinary `nodes` entries of the document,
so everything after the loader (presets, schema, checks, render, plan) treats discovered nodes like written ones.
"""

from __future__ import annotations

from pathlib import Path

from bpdkv.topology.groups import (
    Inventory,
    InventoryNode,
    Machine,
    MembershipChanged,
    check_membership,
    expand_groups,
    membership_change,
    offline_inventory,
)
from bpdkv.topology.validate import ValidatedTopology, load_topology
from bpdkv.topology.yaml_source import LoadedDocument


def load_with_inventory(path: str, page_size: int | None = None) -> tuple[ValidatedTopology, Inventory | None]:
    """Load a topology, discovering its node groups from EC2 (boto3 is imported only when there are groups).

    The Inventory is None for a topology of written nodes only."""
    found: list[Inventory] = []

    def resolve(doc: LoadedDocument) -> LoadedDocument:
        from bpdkv.deploy.inventory.ec2 import Ec2Inventory

        ec2 = Ec2Inventory(page_size=page_size)
        expanded = ec2(doc)
        assert ec2.inventory is not None  # set by every successful call
        found.append(ec2.inventory)
        return expanded

    validated = load_topology(Path(path), path, resolve)
    return validated, (found[0] if found else None)


__all__ = [
    "Inventory",
    "InventoryNode",
    "Machine",
    "MembershipChanged",
    "check_membership",
    "expand_groups",
    "load_with_inventory",
    "membership_change",
    "offline_inventory",
]
