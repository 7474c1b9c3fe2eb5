"""``DistributedDataParallel`` for ``torch.nn.Module``: torch's DDP on commlib and :class:`ddp.Reducer`.

At construction every rank checks that all ranks wrap the same parameters (names, shapes,
dtypes) and takes rank 0's parameters and buffers. Each parameter gets a
``register_post_accumulate_grad_hook``: the moment backward has accumulated its gradient,
the gradient goes into its bucket and a complete bucket's all-reduce starts, while backward
goes on. A callback queued on the autograd engine finalizes at the end of backward: waits,
writes the averages into ``param.grad``. Torch CPU tensors are passed straight to
``commlib.all_reduce`` (the mpi backend uses their memory through DLPack, no copy); CUDA
tensors go to the nccl backend the same way.

``state_dict()`` returns the wrapped module's state dict, keys *without* a ``module.`` prefix
(so checkpoints load into the bare model), and ``load_state_dict`` accepts keys with or without
the prefix (so torch DDP checkpoints load too). Differences from torch's DDP are listed in
``DistributedDataParallel``'s docstring.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.autograd import Variable

import commlib
from commlib.buckets import Reducer
from commlib.buckets.trace import COMPUTE, Tracer, tracer_for
from ddp._join import JoinState
from ddp._sync import broadcast_coalesced, check_devices, verify_shapes
from ddp.comm_hooks import GradBucket

__all__ = ["DistributedDataParallel"]

_PREFIX = "module."


def _grad_ready(ref: weakref.ref, index: int, param: torch.Tensor) -> None:
    """The post-accumulate-grad hook of parameter ``index`` (a no-op once the DDP object is gone)."""
    ddp = ref()
    if ddp is not None:
        ddp._on_grad_ready(index, param)


class DistributedDataParallel(torch.nn.Module):
    """Data-parallel training of ``module``: gradients are averaged over the ranks of ``process_group``.

    Arguments as torch's DDP. Differences: no ``dim`` argument (inputs are never scattered);
    the first iteration already uses reverse-registration-order buckets (torch 2.x starts with
    one bucket unless ``find_unused_parameters``); the first bucket is capped at min(1 MiB,
    ``bucket_cap_mb``) also when ``bucket_cap_mb`` is given; the plan is rebuilt from the
    gradient order after the first iteration also with ``find_unused_parameters``; a parameter
    without gradient is reported at the end of the backward that missed it (and at the next
    forward when no gradient arrived at all); ``static_graph`` only implies
    ``find_unused_parameters``; communication hooks return a future whose ``wait()`` gives the
    averaged tensor (see :mod:`ddp.comm_hooks`); ``join()`` supports only
    ``divide_by_initial_world_size=True``; ``state_dict`` keys carry no ``module.`` prefix.
    ``trace=`` (or ``$COMMLIB_DDP_TRACE``) writes a Chrome-trace timeline per rank (:mod:`ddp.trace`).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        broadcast_buffers: bool = True,
        init_sync: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        *,
        trace: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"DistributedDataParallel: module must be a torch.nn.Module, got {type(module).__qualname__}"
            )
        self.module = module
        self.process_group = process_group
        rank, self._world = commlib.get_rank(process_group), commlib.get_world_size(process_group)
        self._where = f"[rank {rank}/{self._world}] DistributedDataParallel"
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(f"{self._where}: module has no parameter that requires a gradient; DDP is not needed")
        backend = commlib.get_backend(process_group)
        self.device, self.device_ids = check_devices(
            self._where, [p for _, p in named], device_ids, output_device, backend
        )
        self.output_device = output_device
        self.broadcast_buffers = bool(broadcast_buffers)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.static_graph = bool(static_graph)
        self.require_backward_grad_sync = True  # False inside no_sync()
        self.require_forward_param_sync = True  # did the last forward sync? (torch: buffers sync only then)
        if init_sync and self._world > 1:  # as torch: init_sync gates every collective of the constructor
            verify_shapes(self._where, named, process_group)
            broadcast_coalesced([*module.parameters(), *module.buffers()], process_group)
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._tracer = tracer_for(trace, rank)
        self._hook: Callable[[Any, GradBucket], Any] | None = None
        self._hook_state: Any = None
        find_unused = self.find_unused_parameters or self.static_graph
        self.reducer = Reducer(
            self._params,
            names=self._names,
            group=process_group,
            bucket_cap_mb=bucket_cap_mb,
            find_unused=find_unused,
            trace=self._tracer,
            in_place=not self.gradient_as_bucket_view,  # large gradients averaged in .grad itself
        )
        self._init_hooks()

    def _init_hooks(self) -> None:
        """Per-iteration state, one post-accumulate-grad hook per parameter, the state_dict pre-hook."""
        self._used_since_sync = bytearray(len(self._params))  # hooks seen since the last synced backward
        self._expect_hooks = False  # a synced forward ran and its backward has not been finalized
        self._hooks_seen = False  # the current backward has reached at least one parameter
        self._backward_start: float | None = None
        self._join: JoinState | None = None
        me = weakref.ref(self)  # hooks must not keep the DDP object alive
        for index, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(functools.partial(_grad_ready, me, index))
        self.register_load_state_dict_pre_hook(_add_prefix)

    # -- forward ---------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; a grad-enabled forward outside ``no_sync()`` arms the gradient hooks."""
        if self.process_group is None and self.reducer._world is not commlib.group.WORLD:
            self.follow()
        grad_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if grad_sync:  # a forward that will not sync leaves a pending backward alone, as in torch
            self._check_previous_backward()
        buffer_sync = self.require_forward_param_sync and self.broadcast_buffers and self._world > 1
        buffer_sync = buffer_sync and any(True for _ in self.module.buffers())
        source = 0
        if self._join is not None:  # tell ranks that ran out of data what this step communicates
            _, source, _, _ = self._join.notify(True, grad_sync, buffer_sync)
        if buffer_sync:
            broadcast_coalesced(self.module.buffers(), self.process_group, source)
        if self.device_ids:
            inputs, kwargs = _to_device((inputs, kwargs), self.device)
        start = Tracer.now() if self._tracer else 0.0
        if grad_sync:
            self._expect_hooks, self._hooks_seen = True, False
        output = self.module(*inputs, **kwargs)
        self.require_forward_param_sync = grad_sync
        if self._tracer is not None:
            self._tracer.span("forward", COMPUTE, start, Tracer.now())
            if grad_sync:
                self._watch_backward_start(output)
        return output

    def follow(self) -> None:
        """Train over the default group as it is now (after ``commlib.shrink_group`` or ``grow_group``): the
        gradients are averaged over its ranks from the next backward on, and the iteration the failure cut short
        is forgotten. Called by the next forward by itself when ``process_group`` is None (the default group);
        a newcomer and the members then make their states one with :func:`ddp.broadcast_state`."""
        self.reducer.follow()
        rank, self._world = commlib.get_rank(self.process_group), commlib.get_world_size(self.process_group)
        self._where = f"[rank {rank}/{self._world}] DistributedDataParallel"
        self._used_since_sync = bytearray(len(self._params))
        self._expect_hooks = self._hooks_seen = False
        self._backward_start, self._join = None, None

    def _check_previous_backward(self) -> None:
        """Raise when the previous synced forward's backward never finished (torch raises here too)."""
        if not self._expect_hooks:
            return
        self._expect_hooks = False
        if self._hooks_seen:  # a backward started but its end-of-backward callback never ran
            self._hooks_seen = False
            self.reducer.abandon()
            raise RuntimeError(f"{self._where}: the previous backward pass did not finish (did it raise?)")
        raise RuntimeError(
            f"{self._where}: no parameter received a gradient since the previous forward; call backward() "
            "on the output before the next forward, and run forwards that need no backward under "
            "torch.no_grad() or no_sync()"
        )

    def _watch_backward_start(self, output: Any) -> None:
        """For the trace: note when backward reaches the output (that is when it starts)."""
        tensor = next(_tensors(output), None)
        if tensor is not None:
            me = weakref.ref(self)
            tensor.register_hook(lambda grad: _mark_start(me))

    # -- backward --------------------------------------------------------------------------
    def _on_grad_ready(self, index: int, param: torch.Tensor) -> None:
        """Hook body: put the finished gradient in its bucket (may start that bucket's all-reduce)."""
        self._used_since_sync[index] = 1
        if not self._expect_hooks:  # inside no_sync(), or a backward not through this DDP's forward
            return
        if not self._hooks_seen:
            self._hooks_seen = True
            Variable._execution_engine.queue_callback(self._finalize_backward)
            if self._tracer is not None and self._backward_start is None:
                self._backward_start = Tracer.now()
        self._contribute(index, param, used=True)

    def _contribute(self, index: int, param: torch.Tensor, used: bool) -> None:
        """Hand ``param.grad`` to the reducer; with bucket views, make ``.grad`` its view from now on."""
        grad = param.grad
        assert grad is not None  # callers check: hooks run after accumulation, finalize tests it
        if not self.gradient_as_bucket_view:
            self.reducer.ready(index, grad, used=used)
            return
        view = self.reducer.views[index]
        if grad.data_ptr() == view.data_ptr():  # autograd accumulated into the bucket itself
            self.reducer.ready(index, used=used)
        else:  # first backward, or .grad was set to None: copy once, then point .grad at the view
            self.reducer.ready(index, grad, used=used)
            param.grad = view

    def _finalize_backward(self) -> None:
        """End of backward (autograd callback): contribute unused parameters, wait, write ``.grad``."""
        end = Tracer.now() if self._tracer else 0.0
        self._expect_hooks = self._hooks_seen = False
        if self._tracer is not None:
            self._tracer.span("backward", COMPUTE, self._backward_start or end, end)
            self._backward_start = None
        missing = self.reducer.pending()
        if missing and not self.reducer.find_unused:
            self.reducer.abandon()
            raise RuntimeError(self._unused_message(missing))
        for index in missing:  # gradients accumulated under no_sync() count, as in torch
            if self._params[index].grad is not None:
                self._contribute(index, self._params[index], used=bool(self._used_since_sync[index]))
        views = self.reducer.finalize()
        self._used_since_sync = bytearray(len(self._params))
        self._write_grads(views, self.reducer.globally_used)

    def _write_grads(self, views: list[torch.Tensor], used: list[bool]) -> None:
        """Averages into ``.grad``; a parameter no rank used keeps its gradient (None stays None)."""
        with torch.no_grad():
            for p, view, u in zip(self._params, views, used, strict=True):
                if not u:
                    continue
                if self.gradient_as_bucket_view:
                    if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                        p.grad = view
                elif p.grad is None:
                    p.grad = view.clone()
                elif view is not p.grad:  # else averaged in place (Reducer in_place)
                    p.grad.copy_(view)

    def _unused_message(self, missing: list[int]) -> str:
        names = ", ".join(repr(self._names[i]) for i in missing)
        return (
            f"{self._where}: parameters {names} (indices {missing}) received no gradient in this backward pass "
            "on this rank. Every parameter that requires grad must help produce the loss on every rank; "
            "when some do not (in some iterations or always), pass find_unused_parameters=True, or set "
            "requires_grad=False on them before wrapping the module"
        )

    def _run_hook(self, index: int, buffer: torch.Tensor) -> Any:
        """Start one bucket's reduction with the registered communication hook."""
        bucket = self.reducer.plan.buckets[index]
        params = [self._params[p] for p in bucket.params]
        last = index == len(self.reducer.plan.buckets) - 1
        assert self._hook is not None  # installed by register_comm_hook together with this method
        return self._hook(self._hook_state, GradBucket(index, buffer, params, list(bucket.offsets), last))

    # -- public methods --------------------------------------------------------------------
    def register_comm_hook(self, state: Any, hook: Callable[[Any, GradBucket], Any]) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` (see :mod:`ddp.comm_hooks`); once, before training."""
        if not callable(hook):
            raise TypeError(f"{self._where}.register_comm_hook: hook must be callable, got {hook!r}")
        if self._hook is not None:
            raise RuntimeError(f"{self._where}.register_comm_hook: a communication hook can be registered only once")
        self._hook, self._hook_state = hook, state
        self.reducer.set_comm(self._run_hook)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the first one after syncs them all."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    @contextlib.contextmanager
    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Iterator[None]:
        """Train on uneven inputs: a rank that leaves the block early shadows the others until all leave."""
        if divide_by_initial_world_size is not True:
            raise ValueError(
                f"{self._where}.join: only divide_by_initial_world_size=True is supported, "
                f"got {divide_by_initial_world_size!r}"
            )
        if throw_on_early_termination:
            raise ValueError(f"{self._where}.join: throw_on_early_termination=True is not supported")
        if not enable or self._world == 1:
            yield
            return
        if self._join is not None:
            raise RuntimeError(f"{self._where}.join: join() blocks cannot be nested")
        self._join = JoinState(self)
        try:
            yield
            self._join.shadow_until_all_done()
        finally:
            self._join = None

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The wrapped module's state dict (keys without a ``module.`` prefix)."""
        return self.module.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load into the wrapped module; keys may carry torch DDP's ``module.`` prefix or not."""
        keys = list(state_dict)
        if keys and all(k.startswith(_PREFIX) for k in keys):
            metadata = getattr(state_dict, "_metadata", None)
            state_dict = collections.OrderedDict((k[len(_PREFIX) :], v) for k, v in state_dict.items())
            if metadata is not None:  # per-module versions, keyed by module path: strip the prefix there too
                state_dict._metadata = {_strip(k): v for k, v in metadata.items()}  # type: ignore[attr-defined]
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


def _strip(path: str) -> str:
    return "" if path == "module" else path[len(_PREFIX) :] if path.startswith(_PREFIX) else path


def _add_prefix(module: torch.nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """Load pre-hook for a DDP nested in another module: accept keys without ``module.``."""
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + _PREFIX)]:
        state_dict[prefix + _PREFIX + key[len(prefix) :]] = state_dict.pop(key)


def _mark_start(ref: weakref.ref) -> None:
    ddp = ref()
    if ddp is not None and ddp._backward_start is None:
        ddp._backward_start = Tracer.now()


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors in ``obj`` that require grad (through tuples, lists and dicts)."""
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad:
            yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from _tensors(item)


def _to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor moved to ``device`` (through tuples, named tuples, lists and dicts)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to_device(o, device) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj
