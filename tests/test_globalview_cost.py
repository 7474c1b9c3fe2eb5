"""Plans by cost: every admissible plan priced (bytes per rank, forward and backward), the cheapest
chosen, ties kept in the table's order, ``gv.plan(prefer=...)`` pinning a kind; then fully sharded
(every parameter split(0)) training against single-process torch: activations moved at a small
batch, weights at a large one (gathered, released, gathered again in backward, gradients
reduce-scattered), checked by the collectives each step ran."""

from __future__ import annotations

import numpy as np
import pytest
from reference import BACKENDS

import globalview as gv
from commlib.testing import run
from globalview import _cost
from globalview import _signatures as sig

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

S = gv.sbp
F32 = np.dtype(np.float32)


def _linear(
    p: int, batch: int, din: int = 1024, dout: int = 4096, prefer: str | None = None, grad: bool = True, x_grad=False
):
    """x (batch, din) S(0), w (dout, din) S(0), on p ranks (pure: nothing runs); with ``grad``, w is a
    parameter (gathered weights are released and gathered again in backward), without, a plain tensor;
    ``x_grad``: x is an activation that needs a gradient (a hidden layer's input), else data."""
    pl = gv.placement("cpu", list(range(p)))
    return _cost.choose(
        "linear",
        [(batch, din), (dout, din)],
        [F32, F32],
        pl,
        [(S.split(0),), (S.split(0),)],
        sig.linear(2),
        grads=[x_grad, grad],
        weights=[False, True],
        params=[False, grad],
        prefer=prefer,
        flops=("linear",),
        chain=(batch, dout),
    )


@pytest.mark.parametrize("grad", [True, False], ids=["training", "no autograd"])
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize(
    ("batch", "moves", "signature"), [(32, "activations", "B x S(0) -> S(1)"), (8192, "weights", "S(0) x B -> S(0)")]
)
def test_linear_moves_the_fewer_bytes(p: int, batch: int, moves: str, signature: str, grad: bool) -> None:
    choice = _linear(p, batch, grad=grad)
    assert choice.chosen is not None and choice.chosen.moves == moves
    assert choice.chosen.signature() == signature
    assert choice.chosen.nbytes == min(c.nbytes for c in choice.candidates)
    others = [c for c in choice.candidates if c.moves != moves and c.moves != "nothing"]
    assert all(c.nbytes > choice.chosen.nbytes for c in others)
    text = str(choice)
    assert "* " + signature in text and "why: the cheapest" in text, text


@pytest.mark.parametrize("p", [2, 4])
def test_the_price_counts_forward_backward_and_what_follows(p: int) -> None:
    """A hidden layer: the weights are gathered in forward, gathered again in backward (for the input's
    gradient) and their gradient reduce-scattered (3 x the gather); the activations are gathered, their
    gradient reduce-scattered, then the output (batch, 4096) S(1) goes back to S(0) (an all_to_all and its
    adjoint). A first layer (data in) never gathers its weight again."""
    w_gather = (p - 1) * (4096 // p) * 1024 * 4  # bytes each rank receives
    x_gather = (p - 1) * (8192 // p) * 1024 * 4
    out_back = (p - 1) * (8192 // p) * (4096 // p) * 4
    hidden = _linear(p, 8192, x_grad=True)
    by_sig = {c.signature(): c for c in hidden.candidates}
    fsdp, act = by_sig["S(0) x B -> S(0)"], by_sig["B x S(0) -> S(1)"]
    assert (fsdp.forward, fsdp.backward, fsdp.then) == (w_gather, 2 * w_gather, 0)
    assert (act.forward, act.backward, act.then) == (x_gather, x_gather, 2 * out_back)
    assert hidden.released == (False, True) and "gathered again in backward" in str(hidden)
    first = _linear(p, 8192)
    fsdp = {c.signature(): c for c in first.candidates}["S(0) x B -> S(0)"]
    assert (fsdp.forward, fsdp.backward) == (w_gather, w_gather) and first.released == (False, False)
    assert fsdp.flops == act.flops == 2 * (8192 // p) * 4096 * 1024


def test_prefer_pins_a_kind_and_says_so() -> None:
    small = _linear(2, 32, prefer="move_weights")
    assert small.chosen.moves == "weights" and "pinned" in small.reason
    large = _linear(2, 8192, prefer="move_activations")
    assert large.chosen.moves == "activations" and "move_activations" in str(large)
    with pytest.raises(ValueError, match="prefer must be one of"):
        gv.plan(prefer="move_everything")


def test_ties_keep_the_current_layout() -> None:
    """Inputs that fit a signature as they are: no communication, the table's first (today's) choice."""
    pl = gv.placement("cpu", [0, 1])
    rule = sig.elementwise([(8, 4), (8, 4)], (8, 4), "all")
    choice = _cost.choose("add", [(8, 4), (8, 4)], [F32, F32], pl, [(S.broadcast,), (S.broadcast,)], rule)
    assert choice.output == (S.broadcast,) and choice.chosen.moves == "nothing"
    assert "ties" in choice.reason


def test_plan_keeps_the_boxing_planner() -> None:
    pl = gv.placement("cpu", [0, 1])
    assert gv.plan((4, 5), np.float32, (pl, (S.split(0),)), (pl, (S.broadcast,))).collectives == ["all_gather"]
    assert repr(gv.plan(prefer="move_weights")) == "globalview.plan(prefer='move_weights')"


# -- on ranks ------------------------------------------------------------------------------------


def _explain_job() -> dict[int, str]:
    """gv.explain on real global tensors (x split(0), a parameter w split(0)) at batch 32 and 8192."""
    import torch

    import commlib

    pl = gv.placement("cuda" if commlib.get_backend() == "nccl" else "cpu", list(range(commlib.get_world_size())))
    w = gv.zeros(4096, 1024, dtype=torch.float32, placement=pl, sbp=S.split(0), requires_grad=True)
    out = {}
    for batch in (32, 8192):
        x = gv.zeros(batch, 1024, dtype=torch.float32, placement=pl, sbp=S.split(0))
        with gv.record() as calls:
            choice = gv.explain("linear", x, w)
        assert calls == []
        out[batch] = choice.chosen.moves
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_explain_picks_by_bytes_on_ranks(world_size: int) -> None:
    assert run(_explain_job, world_size, timeout=120) == [{32: "activations", 8192: "weights"}] * world_size


def _fsdp_job(din: int, hid: int, batches: tuple[int, ...], steps: int) -> dict:
    """An MLP with every parameter split(0) trained with AdamW against single-process torch, at each batch;
    returns the collectives of each batch's last step (forward and backward) and what the first layer moves."""
    import torch
    import torch.nn.functional as F

    import commlib

    p = commlib.get_world_size()
    pl = gv.placement("cuda" if commlib.get_backend() == "nccl" else "cpu", list(range(p)))
    out: dict = {}
    for batch in batches:
        torch.manual_seed(4)
        layers = [torch.nn.Linear(din, hid), torch.nn.ReLU(), torch.nn.Linear(hid, 3)]
        ref = torch.nn.Sequential(*layers).double()
        net = torch.nn.Sequential(*[torch.nn.Linear(din, hid), torch.nn.ReLU(), torch.nn.Linear(hid, 3)]).double()
        net.load_state_dict(ref.state_dict())
        gv.nn.to_global(net, pl, {n: S.split(0) for n, _ in net.named_parameters()})
        o_ref = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
        o_net = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)
        g = torch.Generator().manual_seed(batch)
        for _ in range(steps):
            xt, yt = (
                torch.randn(batch, din, generator=g, dtype=torch.float64),
                torch.randn(batch, 3, generator=g).double(),
            )
            o_ref.zero_grad()
            F.mse_loss(ref(xt), yt).backward()
            o_ref.step()
            x, y = gv.tensor(xt, placement=pl, sbp=S.split(0)), gv.tensor(yt, placement=pl, sbp=S.split(0))
            o_net.zero_grad()
            with gv.record() as calls:
                F.mse_loss(net(x), y).backward()
            o_net.step()
            for name, value in gv.nn.state_dict(net).items():
                want = ref.state_dict()[name].numpy()
                np.testing.assert_allclose(value.numpy(), want, rtol=1e-6, atol=1e-12, err_msg=f"batch {batch} {name}")
        from globalview._dispatch import as_global  # the global tensor a module's parameter is part of

        first = gv.explain("linear", x, as_global(net[0].weight)).chosen.moves
        out[batch] = {"forward": calls.names("forward"), "backward": calls.names("backward"), "first layer": first}
    return out


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_fully_sharded_adamw_matches_torch(world_size: int, backend: str) -> None:
    """Uneven shapes (din 2p+1, hidden 4p+3); batch 2: activations move; batch 1200: weights move."""
    p = world_size
    results = run(_fsdp_job, world_size, 2 * p + 1, 4 * p + 3, (2, 1200), 3, env=BACKENDS[backend], timeout=300)
    small, large = results[0][2], results[0][1200]
    assert small["first layer"] == "activations" and large["first layer"] == "weights", (small, large)
    # weights (and biases): gathered for each layer (prefetched), gradients reduce-scattered in one bucket
    # (the four are small: one reduce_scatter from the second step on); the second layer's weight is gathered
    # again in backward (for its input's gradient; the first layer's input is data)
    assert large["forward"].count("all_gather") == 4 and large["backward"].count("reduce_scatter") == 1, large
    assert large["backward"].count("all_gather") == 1, large


def _pin_job() -> dict[str, list[str]]:
    """A Linear(5, 7) with weight and bias split(0), batch 2: the cheapest moves the batch; pinned (context or
    module) it moves the weights; a forward that raises leaves no preference behind. Values equal torch's."""
    import torch
    import torch.nn.functional as F

    import commlib
    from globalview._apply import preference

    pl = gv.placement("cuda" if commlib.get_backend() == "nccl" else "cpu", list(range(commlib.get_world_size())))
    torch.manual_seed(0)
    ref = torch.nn.Linear(5, 7).double()
    net = torch.nn.Linear(5, 7).double()
    net.load_state_dict(ref.state_dict())
    gv.nn.to_global(net, pl, {"weight": S.split(0), "bias": S.split(0)})
    xt = torch.randn(2, 5, dtype=torch.float64)
    x = gv.tensor(xt, placement=pl, sbp=S.split(0))
    out = {}

    def forward(label: str) -> None:
        with gv.record() as calls:
            y = net(x)
        np.testing.assert_allclose(y.numpy(), F.linear(xt, ref.weight, ref.bias).detach().numpy(), rtol=1e-12)
        out[label] = calls.names("forward")

    forward("cheapest")
    with gv.plan(prefer="move_weights"):
        forward("context")
    pinned = gv.plan(prefer="move_weights").pin(net)
    forward("pinned module")
    with pytest.raises(ValueError, match="do not fit"):
        net(gv.tensor(torch.randn(2, 3, dtype=torch.float64), placement=pl, sbp=S.split(0)))
    out["after a failed forward"] = [str(preference())]
    assert pinned is net
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_prefer_as_context_and_per_module(world_size: int) -> None:
    got = run(_pin_job, world_size, timeout=120)[0]
    assert got["cheapest"] == ["all_gather"], got  # the batch; the bias stays split like the output
    assert got["context"] == got["pinned module"] == ["all_gather", "all_gather"], got  # weight and bias
    assert got["after a failed forward"] == ["None"], got  # the module's hooks reset it (always_call)
