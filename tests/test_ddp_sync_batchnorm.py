"""ddp.SyncBatchNorm on 2 ranks equals BatchNorm on the concatenated batch: output, gradients, statistics."""

from __future__ import annotations

import numpy as np
import pytest

from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

torch = pytest.importorskip("torch")

SIZES = {0: 3, 1: 5}  # uneven local batches: the statistics must weight ranks by their counts


def _inputs(shape_tail: tuple[int, ...]) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(SIZES[r], 4, *shape_tail, generator=g, dtype=torch.float64) * 3 + 1 for r in SIZES]
    weights = torch.randn(sum(SIZES.values()), 4, *shape_tail, generator=g, dtype=torch.float64)
    return xs, weights


def _reference(net: torch.nn.Module, xs: list[torch.Tensor], weights: torch.Tensor) -> dict:
    x = torch.cat(xs).requires_grad_(True)
    out = net(x)
    (out * weights).sum().backward()
    bn = net[1]
    return {
        "out": out.detach(),
        "dx": x.grad,
        "dw": bn.weight.grad,
        "db": bn.bias.grad,
        "mean": bn.running_mean,
        "var": bn.running_var,
    }


def _compare(shape_tail: tuple[int, ...], norm: type) -> dict:
    import commlib
    import ddp

    rank = commlib.get_rank()
    xs, weights = _inputs(shape_tail)
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Identity(), norm(4).double())
    with torch.no_grad():  # non-trivial affine parameters
        reference[1].weight.uniform_(0.5, 1.5)
        reference[1].bias.uniform_(-1, 1)
    net = ddp.SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.Identity(), norm(4).double()))
    net.load_state_dict(reference.state_dict())
    assert type(net[1]) is ddp.SyncBatchNorm
    want = _reference(reference, xs, weights)
    start = sum(SIZES[r] for r in range(rank))
    mine = slice(start, start + SIZES[rank])
    x = xs[rank].clone().requires_grad_(True)
    out = net(x)
    (out * weights[mine]).sum().backward()
    bn = net[1]
    dw, db = bn.weight.grad.clone(), bn.bias.grad.clone()
    commlib.all_reduce(dw)  # local sums; DDP would average them (here: summed, like the reference's loss)
    commlib.all_reduce(db)
    got = {"out": out.detach(), "dx": x.grad, "dw": dw, "db": db, "mean": bn.running_mean, "var": bn.running_var}
    want["out"], want["dx"] = want["out"][mine], want["dx"][mine]
    errors = {k: float((got[k] - want[k]).abs().max() / (want[k].abs().max() + 1e-30)) for k in got}
    net.eval()  # evaluation uses the (synchronised) running statistics, locally
    errors["eval"] = float((net(xs[rank]) - reference.eval()(xs[rank])).abs().max())
    return errors


def _all_shapes() -> list[dict]:
    torch.set_num_threads(1)
    return [
        _compare((), torch.nn.BatchNorm1d),
        _compare((3,), torch.nn.BatchNorm1d),
        _compare((2, 3), torch.nn.BatchNorm2d),
    ]


@pytest.mark.timeout(120)
def test_sync_batchnorm_equals_batchnorm_on_the_whole_batch() -> None:
    for rank, cases in enumerate(run(_all_shapes, 2, timeout=60)):
        for case in cases:
            assert max(case.values()) < 1e-12, (rank, case)


def test_convert_keeps_parameters_buffers_and_mode() -> None:
    import ddp

    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4), torch.nn.Sequential(torch.nn.BatchNorm1d(4))
    )
    model.eval()
    weight, mean = model[1].weight, model[1].running_mean
    converted = ddp.SyncBatchNorm.convert_sync_batchnorm(model, process_group=None)
    assert type(converted[1]) is ddp.SyncBatchNorm and type(converted[2][0]) is ddp.SyncBatchNorm
    assert converted[1].weight is weight and converted[1].running_mean is mean
    assert not converted[1].training and type(converted[0]) is torch.nn.Conv2d
    with pytest.raises(ValueError, match=r"SyncBatchNorm: input must be \(N, 4, \.\.\.\), got shape \(2, 3\)"):
        converted[1](torch.zeros(2, 3))
    assert np.isfinite(converted[1].eps)
