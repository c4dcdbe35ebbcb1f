"""Placement from Python: the policy is chosen by name, and it decides where sandboxes land across two real agents
(null backend: no processes run)."""

from __future__ import annotations

import collections
import os

import pytest

import dsec
from binding_testlib import Agent


@pytest.fixture(scope="module")
def two_agents(short_tmp):
    agents = [Agent(os.path.join(short_tmp, "pl1"), "pyp-n1", backends="null"),
              Agent(os.path.join(short_tmp, "pl2"), "pyp-n2", backends="null")]
    yield agents
    for a in agents:
        a.stop()


def test_an_unknown_policy_is_refused_before_anything_starts():
    with pytest.raises(dsec.InvalidArgument, match="spread, pack"):
        dsec.Client(endpoints=["unix:/nonexistent/d.sock"], placement="round-robin")


def per_node(sandboxes) -> collections.Counter:
    return collections.Counter(sb.id.rsplit("-", 1)[0] for sb in sandboxes)


@pytest.mark.parametrize("policy", ["spread", "pack"])
def test_spread_spreads_and_pack_packs(two_agents, policy):
    with dsec.Client(endpoints=[a.endpoint for a in two_agents], placement=policy) as c:
        sandboxes = c.create_many(8, kind="null", cpu=0.05, memory="64Mi", ttl=120)
        try:
            counts = per_node(sandboxes)
            if policy == "spread":
                assert counts == {"pyp-n1": 4, "pyp-n2": 4}, counts
            else:
                assert len(counts) == 1 and sum(counts.values()) == 8, counts
        finally:
            for sb in sandboxes:
                sb.destroy()


def test_node_labels_and_gpus_are_visible(two_agents):
    with dsec.Client(endpoints=[two_agents[0].endpoint]) as c:
        (n,) = c.nodes()
        assert n.labels == {} and n.gpus == 0 and n.gpus_free == 0
