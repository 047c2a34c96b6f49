"""The names a command line offers are its registries': every registered workload, policy, press,
metric and allocation appears in the ``--help`` of each command that takes one (real CLI runs), so
that a name added to a registry cannot be missing from a help text written by hand."""

from __future__ import annotations

import json
import re

import pytest

from kvscope.analysis.registry import METRICS
from kvscope.params import specs
from kvscope.policies import REGISTRY as POLICIES
from kvscope.policies import Press
from kvscope.policies.allocation import REGISTRY as ALLOCATIONS
from kvscope.policies.kvpress_bridge import press_names
from kvscope.workloads import WORKLOADS

from .conftest import run_cli

WORKLOAD_NAMES = list(WORKLOADS)
ALLOCATION_NAMES = list(ALLOCATIONS)
POLICY_NAMES = [name for name, cls in POLICIES.items() if cls is not Press]
LIVE_POLICY_NAMES = [name for name, cls in POLICIES.items() if cls is not Press and not cls.clairvoyant]
TUNABLE_POLICY_NAMES = [name for name, cls in POLICIES.items() if cls is not Press and specs(cls)]
PRESS_NAMES = press_names()

# command → the names its --help must list
OFFERED = {
    ("trace",): WORKLOAD_NAMES + LIVE_POLICY_NAMES + PRESS_NAMES + ALLOCATION_NAMES,
    ("run",): WORKLOAD_NAMES + LIVE_POLICY_NAMES + PRESS_NAMES + ALLOCATION_NAMES,
    ("validate",): LIVE_POLICY_NAMES + PRESS_NAMES + ALLOCATION_NAMES,
    ("replay",): POLICY_NAMES + PRESS_NAMES + ALLOCATION_NAMES,
    ("tune",): TUNABLE_POLICY_NAMES + ALLOCATION_NAMES,
    ("analyze",): list(METRICS),
    ("analyze", "fmm"): POLICY_NAMES + PRESS_NAMES + ALLOCATION_NAMES,
}


def _words(text: str) -> set[str]:
    return set(re.findall(r"[A-Za-z0-9_-]+", text))


def test_the_registries_are_not_empty():
    assert {"prose", "code", "niah", "vt", "reasoning", "passkey"} <= set(WORKLOAD_NAMES)
    assert {"h2o", "qevict", "oracle"} <= set(POLICY_NAMES) and "oracle" not in LIVE_POLICY_NAMES
    assert {"uniform", "pyramid", "adakv", "oracle"} <= set(ALLOCATION_NAMES)
    assert {"fmm", "churn", "lir", "peaks", "concentration", "drift"} <= set(METRICS)


@pytest.mark.parametrize("command", list(OFFERED), ids=" ".join)
def test_each_registered_name_appears_in_the_help_of_the_commands_that_take_it(command):
    proc = run_cli(*command, "--help", check=True)
    missing = [name for name in OFFERED[command] if name not in _words(proc.stdout)]
    assert not missing, (command, missing)


def test_the_policy_catalog_lists_every_registered_name():
    doc = json.loads(run_cli("policies", "--json", check=True).stdout)
    assert list(doc["policies"]) == list(POLICIES) and list(doc["allocations"]) == ALLOCATION_NAMES
    assert list(doc["presses"]) == sorted(PRESS_NAMES)  # each with its parameters (tests/test_press_model.py)
    workloads = json.loads(run_cli("workloads", "--json", check=True).stdout)
    assert [w["name"] for w in workloads] == WORKLOAD_NAMES
