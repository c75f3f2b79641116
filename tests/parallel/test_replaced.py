"""Retired parameters, in one process: what may still be asked of them, and how an optimizer
made over them is re-bound at its step."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tessel.parallel import ParallelError
from tessel.parallel.replaced import replace_parameters, retire


@pytest.fixture
def mesh(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("world",))
    dist.destroy_process_group()


def _placed(module: torch.nn.Module, mesh, placements) -> dict:
    """Every parameter of `module` a DTensor (a clone: its storage its own)."""
    return {
        name: torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, placements))
        for name, p in module.named_parameters()
    }


def test_a_retired_parameter_forwards_its_gradient_and_refuses_its_values(mesh):
    linear = torch.nn.Linear(3, 2)
    old = linear.weight
    replace_parameters(linear, _placed(linear, mesh, [Shard(0)]), "the test")
    new = linear.weight
    assert isinstance(new, DTensor) and new is not old
    assert isinstance(old, torch.nn.Parameter) and old.shape == (2, 3) and old.requires_grad
    new.grad = torch.ones_like(new)
    assert old.grad is new.grad
    old.grad = None  # what zero_grad does
    assert new.grad is None
    with pytest.raises(ParallelError, match=r"^weight was used \(mul\) after the test replaced"):
        old * 2
    with pytest.raises(ParallelError, match=r"weight was used \(data\)"):
        old.data  # noqa: B018
    assert "retired parameter weight" in repr(old)


def test_a_successor_shares_the_old_storage_only_where_it_holds_all_of_it(mesh):
    linear = torch.nn.Linear(4, 2)
    early = linear.state_dict()
    initial = {name: value.clone() for name, value in early.items()}
    whole = {
        "weight": torch.nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Replicate()]))
    }
    replace_parameters(linear, whole, "the test")
    # a successor holding a piece of the old storage (rows: a view) is given its own
    rows = {"bias": torch.nn.Parameter(distribute_tensor(linear.bias.detach(), mesh, [Shard(0)]))}
    replace_parameters(linear, rows, "the test")
    with torch.no_grad():
        linear.weight.to_local().add_(1)
        linear.bias.to_local().add_(1)
    assert torch.equal(early["weight"], linear.weight.to_local())  # one storage: trained
    assert torch.equal(early["bias"], initial["bias"])  # a snapshot, not partly updated


def test_an_optimizer_made_before_is_re_bound_at_its_step(mesh, caplog):
    torch.manual_seed(0)
    reference, placed = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    placed.load_state_dict(reference.state_dict())
    x = torch.randn(3, 4)
    want_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    opt = torch.optim.SGD(placed.parameters(), lr=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    torch.optim.lr_scheduler.LambdaLR(want_opt, lambda step: 0.5)
    early = list(placed.parameters())
    replace_parameters(placed, _placed(placed, mesh, [Replicate()]), "the test")
    for model, optimizer, clipped in ((reference, want_opt, None), (placed, opt, early)):
        inputs = distribute_tensor(x, mesh, [Replicate()]) if clipped else x
        out = model(inputs)
        out = out.full_tensor() if isinstance(out, DTensor) else out
        out.square().sum().backward()
        torch.nn.utils.clip_grad_norm_(clipped or list(model.parameters()), 0.1)
        with caplog.at_level(logging.INFO, logger="tessel.parallel.replaced"):
            optimizer.step()
    assert [p for g in opt.param_groups for p in g["params"]] == list(placed.parameters())
    assert "SGD: of the parameters it was given, 2 re-bound" in caplog.text
    assert scheduler.optimizer is opt and opt.param_groups[0]["lr"] == 0.25
    for name, p in reference.named_parameters():
        torch.testing.assert_close(getattr(placed, name).full_tensor(), p.detach())


def test_a_state_loaded_before_is_placed_like_the_successor(mesh):
    linear = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(linear.parameters())
    linear(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    state = {k: v.clone() for k, v in optimizer.state[linear.weight].items()}
    replace_parameters(linear, _placed(linear, mesh, [Shard(0)]), "the test")
    linear.weight.grad = torch.zeros_like(linear.weight)
    linear.bias.grad = torch.zeros_like(linear.bias)
    optimizer.step()
    moved = optimizer.state[linear.weight]
    assert isinstance(moved["exp_avg_sq"], DTensor)
    assert moved["exp_avg_sq"].placements == (Shard(0),)
    # zero gradients: the squares decay by beta2, from the state loaded
    torch.testing.assert_close(moved["exp_avg_sq"].full_tensor(), state["exp_avg_sq"] * 0.999)


def test_state_that_cannot_be_placed_fails_the_step_by_name(mesh):
    linear = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(linear.parameters(), lr=0.1, momentum=0.9)
    optimizer.state[linear.weight]["momentum_buffer"] = torch.zeros(5)
    replace_parameters(linear, _placed(linear, mesh, [Replicate()]), "the test")
    linear.weight.grad = torch.zeros_like(linear.weight)
    with pytest.raises(ParallelError, match=r"state 'momentum_buffer' of weight .* shape \(5,\)"):
        optimizer.step()


def test_parameters_held_elsewhere_leave_the_optimizer(mesh, caplog):
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    for name, p in second.named_parameters():
        retire(p, None, f"second.{name}", "the pipeline")
    assert second.weight.grad is None
    with pytest.raises(ParallelError, match="second.weight was given a gradient, but this rank"):
        second.weight.grad = torch.ones(2, 2)
    first(torch.ones(1, 2)).sum().backward()
    with caplog.at_level(logging.INFO, logger="tessel.parallel.replaced"):
        optimizer.step()
    assert optimizer.param_groups[0]["params"] == list(first.parameters())
    assert "2 of pipeline stages other ranks hold dropped" in caplog.text


def test_an_optimizer_holding_a_parameter_and_its_successor_is_refused(mesh):
    linear = torch.nn.Linear(2, 2)
    early = list(linear.parameters())
    replace_parameters(linear, _placed(linear, mesh, [Replicate()]), "the test")
    optimizer = torch.optim.SGD([{"params": early}, {"params": list(linear.parameters())}])
    with pytest.raises(ParallelError, match=r"holds \['bias', 'weight'\] twice"):
        optimizer.step()
