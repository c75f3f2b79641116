"""A build checks itself against the eager model, and says when the check was not worth its cost."""

from __future__ import annotations

import pytest
import torch
from tests.conftest import small_llama, token_ids

import tessel
from tessel.builder import pipeline
from tessel.builder.verify import VerifyError, forward_seconds, worth_checking
from tessel.capture import capture
from tessel.config.soc import soc_profile
from tessel.package.plan_report import Verified
from tessel.plan import has_rule


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    return capture(small_llama(), (token_ids(),), keep=has_rule)


def test_a_package_that_disagrees_with_eager_is_refused(captured, monkeypatch):
    pack = pipeline.pack

    def pack_a_wrong_weight(*args, **kwargs):
        manifest, members = pack(*args, **kwargs)
        for member in members.values():
            if isinstance(member, dict):
                name = next(k for k, t in member.items() if t.is_floating_point())
                member[name] = member[name] + 0.5
                break
        return manifest, members

    monkeypatch.setattr(pipeline, "pack", pack_a_wrong_weight)
    with pytest.raises(VerifyError, match="disagrees with the model on the example inputs"):
        tessel.build(captured, cluster=2, verify=True)


def test_the_check_runs_by_default_where_it_costs_less_than_the_build(captured, monkeypatch):
    built = tessel.build(captured, cluster=2)
    assert built.manifest.plan.verify.max_relative_diff <= 1e-4

    monkeypatch.setattr(pipeline, "worth_checking", lambda *a: "skipped: too dear")
    skipped = tessel.build(captured, cluster=2)
    assert skipped.manifest.plan.verify == Verified(skipped="skipped: too dear")
    forced = tessel.build(captured, cluster=2, verify=True)
    assert forced.manifest.plan.verify.max_relative_diff <= 1e-4
    assert tessel.build(captured, cluster=2, verify=False).manifest.plan.verify is None


def test_the_cost_of_a_check_grows_with_the_example_inputs(captured):
    soc = soc_profile("cpu")
    longer = capture(small_llama(), (token_ids(batch=8, seq=64),), keep=has_rule)
    small, large = forward_seconds(captured, soc), forward_seconds(longer, soc)
    assert 0 < small < large
    assert worth_checking(captured, build_seconds=3 * small) is None
    reason = worth_checking(captured, build_seconds=small)
    assert reason is not None and "verify=True" in reason
