"""globalview trains: an MLP and a one-block transformer under data, tensor (column + row), 2-D
(data x tensor on a 2 x 2 mesh) and 2-stage pipeline parallelism, with SGD and AdamW, against
single-process torch training on the whole batch (float64, every step, every parameter); the
gradient of every boxing conversion and of every operator against torch autograd (values, sbp,
and the collectives backward ran); the errors for bad input. One job per (world size, backend),
each returning scenario -> outcome (torch is imported once per rank)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from reference import BACKENDS

from commlib.testing import run

pytestmark = pytest.mark.warm_ranks  # commlib.testing.run reuses warm ranks (tests/conftest.py)

STEPS = 5
RTOL = 1e-6


def _outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except AssertionError as e:
        return f"failed: {e}"


# -- models ------------------------------------------------------------------------------------


def _mlp(torch, din: int, hid: int, dout: int):
    torch.manual_seed(1)
    layers = [torch.nn.Linear(din, hid), torch.nn.ReLU(), torch.nn.Linear(hid, hid), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(hid, dout)).double()


def _block(torch, vocab: int = 11, d: int = 6, heads: int = 2, hidden: int = 8):
    """A one-block transformer language model in two stages (attention, then MLP and head)."""
    import globalview as gv

    nn, F = torch.nn, torch.nn.functional

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.ln = nn.Embedding(vocab, d), nn.LayerNorm(d)
            self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

        def forward(self, ids):
            b, t = ids.shape
            x = self.emb(ids)
            h = self.ln(x)
            q, k, v = (m(h).view(b, t, heads, d // heads).transpose(1, 2) for m in (self.q, self.k, self.v))
            att = ((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // heads))).softmax(-1)
            att = gv.nn.functional.dropout(att, 0.1, self.training)
            y = (att @ v).transpose(1, 2).reshape(b, t, d)
            return x + self.o(y)

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.fc1, self.fc2, self.out = nn.LayerNorm(d), nn.Linear(d, hidden), nn.Linear(hidden, d), None
            self.out = nn.Linear(d, vocab)

        def forward(self, x, targets):
            x = x + self.fc2(F.gelu(self.fc1(self.ln(x))))
            logits = self.out(x)
            b, t, _ = logits.shape
            return F.cross_entropy(logits.reshape(b * t, vocab), targets.reshape(b * t))

    torch.manual_seed(2)
    return nn.ModuleList([Attention(), Head()]).double()


TP_MLP = {"0.weight": "S0", "0.bias": "S0", "2.weight": "S1", "4.weight": "S0", "4.bias": "S0"}
TP_BLOCK = {f"0.{m}.weight": "S0" for m in "qkv"} | {f"0.{m}.bias": "S0" for m in "qkv"}
TP_BLOCK |= {"0.o.weight": "S1", "1.fc1.weight": "S0", "1.fc1.bias": "S0", "1.fc2.weight": "S1"}


def _layouts(gv, kind: str, names: dict, ndim: int):
    S = gv.sbp
    one = {"S0": S.split(0), "S1": S.split(1)}
    if kind == "tp":
        return {k: one[v] for k, v in names.items()}
    if kind == "2d":
        return {k: (S.broadcast, one[v]) for k, v in names.items()} | {"__default__": (S.broadcast, S.broadcast)}
    return None


def _stages(gv, commlib, kind: str):
    """(placement of stage 0, placement of stage 1, batch sbp, layout kind of the weights)."""
    p, dev = commlib.get_world_size(), "cuda" if commlib.get_backend() == "nccl" else "cpu"
    S, ranks = gv.sbp, list(range(p))
    if kind == "2d":
        mesh = gv.placement(dev, [[0, 1], [2, 3]])
        return mesh, mesh, (S.split(0), S.broadcast)
    if kind == "pipe":
        half = max(1, p // 2)
        first, second = ranks[:half], ranks[half:] or ranks[:half]
        return gv.placement(dev, first), gv.placement(dev, second), S.split(0)
    pl = gv.placement(dev, ranks)
    return pl, pl, S.split(0) if kind == "dp" else S.broadcast


def _make_global(gv, module, pl, sbp_map):
    if sbp_map is None:
        return gv.nn.to_global(module, pl)
    default = sbp_map.pop("__default__", None)
    if default is not None:
        sbp_map = {n: sbp_map.get(n, default) for n, _ in [*module.named_parameters(), *module.named_buffers()]}
    return gv.nn.to_global(module, pl, sbp_map)


def _train(kind: str, model: str, opt_name: str, shape: str) -> None:
    """Train ``model`` 5 steps laid out as ``kind``; compare every parameter with torch after each step."""
    import torch
    import torch.nn.functional as F

    import commlib
    import globalview as gv

    p = commlib.get_world_size()
    n = 4 * p + (1 if shape == "uneven" else 0)
    hid = 2 * p + (3 if shape == "uneven" else 2)
    pl0, pl1, batch_sbp = _stages(gv, commlib, kind)
    g = torch.Generator().manual_seed(3)
    if model == "mlp":
        x_t, y_t = (
            torch.randn(n, 5, generator=g, dtype=torch.float64),
            torch.randn(n, 3, generator=g, dtype=torch.float64),
        )
        ref, net = _mlp(torch, 5, hid, 3), _mlp(torch, 5, hid, 3)
        names = TP_MLP
    else:
        x_t, y_t = torch.randint(0, 11, (n, 4), generator=g), torch.randint(0, 11, (n, 4), generator=g)
        ref, net = _block(torch), _block(torch)
        names = TP_BLOCK
    if kind == "pipe":
        split = {"mlp": 2, "block": 1}[model]
        stage0 = torch.nn.Sequential(*list(net)[:split]) if model == "mlp" else net[0]
        stage1 = torch.nn.Sequential(*list(net)[split:]) if model == "mlp" else net[1]
        _make_global(gv, stage0, pl0, None)
        _make_global(gv, stage1, pl1, None)
    else:
        sbp_map = _layouts(gv, kind, dict(names), 2)
        _make_global(gv, net, pl0, sbp_map)

    def opt(m):
        if opt_name == "sgd":
            return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1)

    o_ref, o_net = opt(ref), opt(net)
    if kind == "pipe":  # micro-batches draw their own dropout masks: compare without dropout
        ref.eval(), net.eval()

    def loss_of(m, x, y, frac=1.0):
        if model == "mlp":
            if kind == "pipe":
                h = m[:split](x).to_global(placement=pl1, sbp=batch_sbp)
                return F.mse_loss(m[split:](h), y.to_global(placement=pl1), reduction="sum") * (1.0 / y_t.numel())
            return F.mse_loss(m(x), y)
        if kind == "pipe":
            h = m[0](x).to_global(placement=pl1, sbp=batch_sbp)
            return m[1](h, y.to_global(placement=pl1)) * frac
        return m[1](m[0](x), y)

    for step in range(STEPS):
        gv.manual_seed(step)
        loss = F.mse_loss(ref(x_t), y_t) if model == "mlp" else ref[1](ref[0](x_t), y_t)
        o_ref.zero_grad()
        loss.backward()
        o_ref.step()
        gv.manual_seed(step)
        o_net.zero_grad()
        micro = [(0, n)] if kind != "pipe" else [(0, n // 2), (n // 2, n)]  # two micro-batches
        for lo, hi in micro:
            x = gv.tensor(x_t[lo:hi], placement=pl0, sbp=batch_sbp)
            y = gv.tensor(y_t[lo:hi], placement=pl0, sbp=batch_sbp)
            loss_of(net, x, y, (hi - lo) / n).backward()
        o_net.step()
        _compare(gv, commlib, net, ref, step)


def _compare(gv, commlib, net, ref, step: int) -> None:
    """Each rank's part of every parameter against the same block of torch's (no communication)."""
    from globalview._layout import block

    want = ref.state_dict()
    for name, value in gv.nn.state_dict(net).items():
        coords = value.placement.coords(commlib.get_rank())
        if coords is None:
            assert value.to_local().numel() == 0, f"{name}: a rank outside the placement holds data"
            continue
        ranges = block(value.shape, value.placement.hierarchy, value.sbp, coords)
        part = want[name].numpy()[tuple(slice(lo, hi) for lo, hi in ranges)]
        got = value.to_local().numpy()
        np.testing.assert_allclose(got, part, rtol=RTOL, atol=1e-12, err_msg=f"step {step} {name}")


def _kinds(p: int) -> list[str]:
    return ["dp", "tp", "pipe"] + (["2d"] if p == 4 else [])


def train_scenarios(p: int) -> list[str]:
    """The training scenarios of a world of ``p`` ranks, by name."""
    out = [f"mlp {k} {o} {s}" for k in _kinds(p) for o, s in (("sgd", "even"), ("adamw", "uneven"))]
    return out + [f"block {k} adamw uneven" for k in _kinds(p)]


def train_job() -> dict[str, str]:
    import commlib

    out = {}
    for name in train_scenarios(commlib.get_world_size()):
        model, kind, opt, shape = name.split()
        out[name] = _outcome(lambda: _train(kind, model, opt, shape))  # noqa: B023
    return out


# -- gradients of every conversion and operator ------------------------------------------------

LAYOUTS = ["B", "S0", "S1", "P"]
CONVERSIONS = [f"{a}->{b}" for a, b in itertools.product(LAYOUTS, repeat=2)]
# The collectives each operator's backward runs on more than one rank (sorted), and the inputs' layouts.
OPERATORS = {
    "matmul S0xB": (["all_reduce"], ("S0", "B"), lambda gv, a, b: a @ b),
    "matmul BxS1": (["all_reduce"], ("B", "S1"), lambda gv, a, b: a @ b),
    "matmul S1xS0": ([], ("S1", "S0"), lambda gv, a, b: a @ b),
    "add S0+S1": (["all_to_all"], ("S0", "S1"), lambda gv, a, b: a + b),
    "mul PxB": (["all_reduce"], ("P", "B"), lambda gv, a, b: a * b),
    "sub/div S0": ([], ("S0", "S0"), lambda gv, a, b: (a - b) / (b * b + 1.0)),
    "sum0 S0": ([], ("S0",), lambda gv, a: a.sum(0)),
    "mean S1": ([], ("S1",), lambda gv, a: a.mean()),
    "max over split": (None, ("S0",), lambda gv, a: gv.max(a, 0)),
    "transpose S0": ([], ("S0",), lambda gv, a: a.T),
    "exp tanh S1": ([], ("S1",), lambda gv, a: gv.exp(gv.tanh(a))),
    "getitem S0": (None, ("S0",), lambda gv, a: a[1:-1, 1:]),
    "reshape S0": (None, ("S0",), lambda gv, a: a.reshape(-1)),
    "linear column": (["all_reduce"], ("B", "S0", "S0"), lambda gv, x, w, b: gv.nn.functional.linear(x, w, b)),
    "linear row": (["all_reduce"], ("S1", "S1", "B"), lambda gv, x, w, b: gv.nn.functional.linear(x, w, b)),
    "relu gelu S0": ([], ("S0",), lambda gv, a: gv.nn.functional.gelu(gv.nn.functional.relu(a))),
    "softmax S0": ([], ("S0",), lambda gv, a: gv.nn.functional.softmax(a, -1)),
    "log_softmax S1": (None, ("S1",), lambda gv, a: gv.nn.functional.log_softmax(a, 1)),
    "layer_norm S0": (
        ["all_reduce", "all_reduce"],
        ("S0", "B", "B"),
        lambda gv, a, w, b: gv.nn.functional.layer_norm(a, (a.shape[-1],), w, b),
    ),
    "dropout S1": ([], ("S1",), lambda gv, a: gv.nn.functional.dropout(a, 0.3)),
}
SHAPES = {  # input shapes of each operator, for a world of p ranks (uneven on purpose)
    "matmul": lambda p: [(2 * p + 1, 3), (3, p + 2)],
    "matmul S1xS0": lambda p: [(3, 2 * p + 1), (2 * p + 1, 4)],
    "linear": lambda p: [(3, 2 * p + 1), (p + 2, 2 * p + 1), (p + 2,)],
    "layer_norm": lambda p: [(2 * p + 1, 5), (5,), (5,)],
}


def _shapes(name: str, p: int) -> list:
    for key in (name, name.split()[0]):
        if key in SHAPES:
            return SHAPES[key](p)
    n = len(OPERATORS[name][1])
    return [(2 * p + 1, p + 3)] * n


def _leaf(gv, torch, commlib, truth, pl, name):
    """A leaf global tensor of value ``truth`` laid out as ``name`` (partial: genuine parts)."""
    S = gv.sbp
    sbp = {"B": S.broadcast, "S0": S.split(0), "S1": S.split(1), "P": S.partial_sum}[name]
    if name != "P":
        return gv.tensor(truth, placement=pl, sbp=sbp).requires_grad_()
    p, me = commlib.get_world_size(), commlib.get_rank()
    g = torch.Generator().manual_seed(9)
    parts = [torch.randint(-5, 5, truth.shape, generator=g).double() for _ in range(p - 1)]
    parts.append(truth - sum(parts, torch.zeros_like(truth)))
    return gv.to_global(parts[me], pl, sbp).requires_grad_()


def _check_grads(gv, torch, commlib, leaves, truths, fn, want_calls) -> None:
    """loss = sum(fn(leaves) * c): gradients (values and sbp) and backward's collectives."""
    p = commlib.get_world_size()
    out = fn(*leaves)
    c = torch.linspace(-1, 2, math.prod(out.shape), dtype=torch.float64).reshape(out.shape)
    loss = (out * gv.tensor(c, placement=out.placement, sbp=(gv.sbp.broadcast,) * out.placement.ndim)).sum()
    with gv.record() as calls:
        loss.backward()
    ref = [t.clone().requires_grad_() for t in truths]
    gv.manual_seed(0)
    (fn(*ref) * c).sum().backward()
    for i, (leaf, r) in enumerate(zip(leaves, ref, strict=True)):
        assert leaf.grad is not None and leaf.grad.sbp == leaf.sbp, f"input {i}: grad sbp {leaf.grad and leaf.grad.sbp}"
        np.testing.assert_allclose(leaf.grad.numpy(), r.grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=f"input {i}")
    got = sorted(calls.names("backward"))
    assert got == (sorted(want_calls) if p > 1 else []), f"backward ran {got}, expected {sorted(want_calls)}"
    assert not calls.names("forward") or calls.nbytes("forward") > 0


def _conversion(gv, torch, commlib, pl, a: str, b: str) -> None:
    from globalview._plan import adjoint, dual, plan

    p = commlib.get_world_size()
    truth = torch.arange(float((4 * p + 1) * (2 * p + 3)), dtype=torch.float64).reshape(4 * p + 1, 2 * p + 3)
    x = _leaf(gv, torch, commlib, truth, pl, a)
    target = _leaf(gv, torch, commlib, truth, pl, b).sbp
    fwd = x.plan_to(pl, target)
    want = [s.kind for q in adjoint(fwd) for s in q.steps if s.is_collective]
    want += plan(x.shape, np.float64, (pl, dual(x.sbp)), (pl, x.sbp)).collectives  # the leaf's P -> B
    _check_grads(gv, torch, commlib, [x], [truth], lambda t: t.to_global(sbp=target) if hasattr(t, "sbp") else t, want)


def _operator(gv, torch, commlib, pl, name: str) -> None:
    want, layouts, fn = OPERATORS[name]
    p = commlib.get_world_size()
    g = torch.Generator().manual_seed(5)
    truths = [torch.randn(s, generator=g, dtype=torch.float64) for s in _shapes(name, p)]
    leaves = [_leaf(gv, torch, commlib, t, pl, lay) for t, lay in zip(truths, layouts, strict=True)]
    if want is None:  # the input is re-laid out in forward: backward runs the adjoint of that plan
        want = _adjoint_collectives(gv, pl, name, leaves[0])

    def local_fn(*args):
        if isinstance(args[0], torch.Tensor):  # the single-process reference: the same op in torch
            return fn(_TorchOps(gv, torch), *args)
        return fn(gv, *args)

    gv.manual_seed(0)
    _check_grads(gv, torch, commlib, leaves, truths, local_fn, want)


def _adjoint_collectives(gv, pl, name: str, leaf) -> list[str]:
    from globalview._plan import adjoint

    if name.startswith("getitem"):
        fwd = gv.explain("getitem", leaf, (slice(1, -1), slice(1, None))).boxing[0]
    elif name.startswith("max"):  # under autograd, max over a split dimension re-lays the input out first
        fwd = gv.explain("max", leaf, 0).boxing[0]
    elif name.startswith("reshape"):
        fwd = gv.explain("reshape", leaf, -1).boxing[0]
    else:  # log_softmax over the split dimension: re-split on the other one
        fwd = leaf.plan_to(pl, (gv.sbp.split(0),))
    return [s.kind for q in adjoint(fwd) for s in q.steps if s.is_collective]


class _TorchOps:
    """What the operator table calls, on plain torch tensors (the single-process reference)."""

    def __init__(self, gv, torch) -> None:
        self.exp, self.tanh, self.nn = torch.exp, torch.tanh, gv.nn
        self.max = torch.amax


def grads_job() -> dict[str, str]:
    import torch

    import commlib
    import globalview as gv

    p = commlib.get_world_size()
    pl = gv.placement("cuda" if commlib.get_backend() == "nccl" else "cpu", list(range(p)))
    out = {}
    for name in CONVERSIONS:
        a, b = name.split("->")
        out[name] = _outcome(lambda a=a, b=b: _conversion(gv, torch, commlib, pl, a, b))
    for name in OPERATORS:
        out[name] = _outcome(lambda name=name: _operator(gv, torch, commlib, pl, name))
    return out


# -- bad input, the seed's linear regression -----------------------------------------------------


def _raises(exc, text: str, fn) -> None:
    import globalview as gv

    with gv.record() as calls:
        try:
            fn()
        except exc as e:
            assert text in str(e), f"{text!r} not in {e}"
            assert calls == [], f"a collective ran before the error: {calls}"
            return
    raise AssertionError(f"no {exc.__name__} raised")


def errors_job() -> dict[str, str]:
    import torch

    import commlib
    import globalview as gv

    p, S = commlib.get_world_size(), gv.sbp
    pl = gv.placement("cuda" if commlib.get_backend() == "nccl" else "cpu", list(range(p)))
    x = gv.randn(4, 3, dtype=torch.float64, placement=pl, sbp=S.split(0), requires_grad=True)
    other = gv.placement(pl.type, [0])
    w = gv.randn(2, 3, dtype=torch.float64, placement=other, sbp=S.broadcast)
    out = {
        "param cannot take sbp": _outcome(
            lambda: _raises(
                ValueError,
                "'0.bias'",
                lambda: gv.nn.to_global(torch.nn.Sequential(torch.nn.Linear(3, 2)), pl, {"0.bias": S.split(1)}),
            )
        ),
        "unknown parameter name": _outcome(
            lambda: _raises(
                ValueError, "'fc.weight'", lambda: gv.nn.to_global(torch.nn.Linear(3, 2), pl, {"fc.weight": S.split(0)})
            )
        ),
        "backward on a non-scalar": _outcome(lambda: _raises(RuntimeError, "shape (4, 3)", lambda: (x * 2).backward())),
        "local torch tensor among global ones": _outcome(
            lambda: _raises(TypeError, "local torch tensor", lambda: torch.nn.functional.linear(x, torch.ones(2, 3)))
        ),
    }
    out.update(_loss_arguments(gv, torch, pl))
    if p > 1:
        out["operands on different placements"] = _outcome(
            lambda: _raises(ValueError, "for weight", lambda: gv.nn.functional.linear(x, w))
        )
    commlib.barrier()  # every rank is still in step
    return out


def _loss_arguments(gv, torch, pl) -> dict[str, str]:
    """The losses take torch's arguments by torch's positions; what they cannot do is refused by name."""
    F = torch.nn.functional
    full = torch.randn(4, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    t = torch.tensor([0, 1, 2, 1])
    logits = gv.to_global(full, pl, gv.sbp.broadcast).to_global(sbp=gv.sbp.split(0))
    target = gv.to_global(t, pl, gv.sbp.broadcast)
    weight = gv.to_global(torch.ones(3), pl, gv.sbp.broadcast)

    def positional() -> None:  # weight, size_average, ignore_index, reduce, reduction
        for fn, inp in ((F.cross_entropy, full), (F.nll_loss, F.log_softmax(full, -1))):
            x = logits if fn is F.cross_entropy else F.log_softmax(logits, -1)
            got, want = fn(x, target, None, None, 1, None, "sum"), fn(inp, t, None, None, 1, None, "sum")
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, err_msg=fn.__name__)

    return {
        "losses by torch's positions": _outcome(positional),
        "label_smoothing refused": _outcome(
            lambda: _raises(
                ValueError, "cross_entropy: not supported", lambda: F.cross_entropy(logits, target, label_smoothing=0.1)
            )
        ),
        "weight refused, named": _outcome(
            lambda: _raises(
                ValueError,
                "cross_entropy: not supported",
                lambda: F.cross_entropy(logits, target, weight),
            )
        ),
        "a misspelt argument is torch's TypeError": _outcome(
            lambda: _raises(
                TypeError, "'reductions'", lambda: gv.nn.functional.nll_loss(logits, target, reductions="sum")
            )
        ),
    }


def test_operators_take_torch_signatures() -> None:
    """globalview.nn.functional shows torch.nn.functional's names, positions and defaults."""
    import inspect

    import torch.nn.functional as F

    import globalview.nn.functional as G

    def shape(fn) -> list:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    for name in G.__all__:
        try:
            want = shape(getattr(F, name))
        except ValueError:  # a builtin (linear, gelu): no signature to read
            continue
        assert shape(getattr(G, name)) == want, name


def regression_job() -> list:
    """The seed's linear regression (OneFlow's DDP example) with global tensors: w broadcast, data split(0)."""
    import torch

    import commlib
    import globalview as gv

    me = commlib.get_rank()
    pl = gv.placement("cuda" if commlib.get_backend() == "nccl" else "cpu", [0, 1])
    train_x = [torch.tensor([[1.0, 2], [2, 3]]), torch.tensor([[4.0, 6], [3, 1]])]
    train_y = [torch.tensor([[8.0], [13]]), torch.tensor([[26.0], [9]])]
    w = gv.zeros(2, 1, dtype=torch.float32, placement=pl, sbp=gv.sbp.broadcast, requires_grad=True)
    optimizer = torch.optim.SGD([w.to_local()], lr=0.01)
    x, y = gv.to_global(train_x[me], pl, gv.sbp.split(0)), gv.to_global(train_y[me], pl, gv.sbp.split(0))
    for _ in range(500):
        loss = torch.nn.functional.mse_loss(x @ w, y, reduction="sum")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return w.numpy().tolist()


# -- the jobs, by world size and backend -------------------------------------------------------


EXAMPLES = {
    2: ["data_parallel.py", "model_parallel.py", "pipeline.py", "linear_regression.py"],
    3: ["fully_sharded.py"],
    4: ["hybrid_2d.py"],
}


def examples_job() -> dict[str, list[str]]:
    """The training tutorials of examples/globalview/, run in these ranks (torch is imported already)."""
    import contextlib
    import io
    import runpy
    from pathlib import Path

    import commlib

    out = {}
    for script in EXAMPLES.get(commlib.get_world_size(), []):
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "globalview" / script))
        out[script] = text.getvalue().splitlines()
    return out


def _job(with_regression: bool) -> dict:
    out = {"train": train_job(), "grads": grads_job(), "errors": errors_job(), "examples": examples_job()}
    if with_regression:
        out["regression"] = regression_job()
    return out


def _check_examples(by_rank: list[dict]) -> None:
    """Every rank printed 5 losses equal to the single-process run's; the regression found w."""
    for printed in by_rank:
        for script, lines in printed.items():
            if script == "linear_regression.py":
                w = next(line for line in lines if line.startswith("w:"))
                np.testing.assert_allclose(eval(w[2:]), [[2.0], [3.0]], atol=1e-3)
                continue
            steps = [line.split() for line in lines if line.startswith("step ")]
            assert len(steps) == 5, (script, lines)
            for words in steps:  # "step i loss L single S", and "pinned P" (fully_sharded.py: plans pinned)
                np.testing.assert_allclose(float(words[3]), float(words[5]), rtol=1e-9, err_msg=script)
                for pinned in words[7:8]:
                    np.testing.assert_allclose(float(pinned), float(words[5]), rtol=1e-9, err_msg=script)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_globalview_trains(world_size: int, backend: str) -> None:
    results = run(_job, world_size, world_size == 2, env=BACKENDS[backend], timeout=300)
    r0 = results[0]
    _check_examples([r["examples"] for r in results])
    assert set(r0["examples"]) == set(EXAMPLES.get(world_size, []))
    assert r0["train"] == dict.fromkeys(train_scenarios(world_size), "ok")
    assert r0["grads"] == dict.fromkeys([*CONVERSIONS, *OPERATORS], "ok")
    assert r0["errors"] == dict.fromkeys(r0["errors"], "ok")
    if world_size == 2:
        np.testing.assert_allclose(r0["regression"], [[2.0], [3.0]], atol=1e-3)
