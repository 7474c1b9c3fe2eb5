"""host_view: zero-copy numpy views of DLPack exporters (torch, numpy, a hand-built producer), every dtype."""

from __future__ import annotations

import ctypes
import gc
import weakref
from typing import ClassVar

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from commlib.arrays import _dlpack  # noqa: E402
from commlib.arrays._dlpack import device_of, host_view  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
# torch dtype -> the numpy dtype host_view must produce.
DTYPES = {
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.int16: np.int16,
    torch.uint16: np.uint16,
    torch.int32: np.int32,
    torch.uint32: np.uint32,
    torch.int64: np.int64,
    torch.uint64: np.uint64,
    torch.float16: np.float16,
    torch.bfloat16: BF16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
    torch.bool: np.bool_,
}


class Exporter:
    """A third-party exporter forwarding to another object's DLPack methods (the generic path)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = []

    def __dlpack__(self, **kwargs):
        self.calls.append(kwargs)
        return self.inner.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.inner.__dlpack_device__()


def torch_path(t):
    return host_view(t)


def exporter_path(t):
    return host_view(Exporter(t))


def ctypes_path(t):
    """Force commlib's own ctypes consumer on a versioned capsule (numpy's is tried first otherwise)."""
    return _dlpack._own_consume(t.__dlpack__(max_version=(1, 0)))


def legacy_ctypes_path(t):
    return _dlpack._own_consume(t.__dlpack__())


PATHS = [torch_path, exporter_path, ctypes_path, legacy_ctypes_path]


def sample(dtype, shape=(3, 4)):
    """A tensor of `dtype` whose values are exact in every dtype (negative where signed)."""
    n = int(np.prod(shape))
    if dtype is torch.bool:
        return (torch.arange(n) % 3 == 0).reshape(shape)
    base = torch.arange(n, dtype=torch.float64) - (n // 2 if dtype.is_signed else 0)
    if dtype.is_complex:
        return torch.complex(base / 4, -base).to(dtype).reshape(shape)
    return (base / 4 if dtype.is_floating_point else base).to(dtype).reshape(shape)


def reference(t):
    """Exact numpy values of `t` (bfloat16 widened through float64)."""
    if t.dtype is torch.bfloat16:
        return t.double().numpy()
    return t.numpy().copy()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips(dtype, path):
    t = sample(dtype)
    v = path(t)
    assert v.dtype == np.dtype(DTYPES[dtype])
    assert v.shape == (3, 4) and v.flags.writeable
    ref = reference(t)
    np.testing.assert_array_equal(v.astype(ref.dtype), ref)
    assert v.ctypes.data == t.data_ptr()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64], ids=str)
def test_zero_copy_both_ways(dtype, path):
    t = sample(dtype)
    v = path(t)
    v[1, 2] = v[0, 0]
    assert t[1, 2] == t[0, 0]
    t[2, 3] = t[0, 3]
    assert v[2, 3] == v[0, 3]
    t.zero_()
    assert not v.any()


VIEWS = {  # of a (3, 4, 5) tensor
    "transposed": lambda t: t.transpose(0, 2),
    "stepped": lambda t: t[:, ::2, 1:],
    "offset_stepped_permuted": lambda t: t[1:, 1:, ::3].permute(2, 0, 1),
    "broadcast": lambda t: t[0, 0].expand(3, 5),
    "slice_at_offset": lambda t: t.reshape(-1)[7:19],
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=str)
@pytest.mark.parametrize("kind", VIEWS)
def test_non_contiguous_and_offset_views(kind, dtype, path):
    base = sample(dtype, (3, 4, 5))
    t = VIEWS[kind](base)
    v = path(t)
    size = v.dtype.itemsize
    assert v.shape == tuple(t.shape)
    assert v.strides == tuple(s * size for s in t.stride())
    assert v.ctypes.data == t.data_ptr() == base.data_ptr() + t.storage_offset() * size
    np.testing.assert_array_equal(v.astype(np.float64), t.double().numpy())
    if kind != "broadcast":
        v[(0,) * v.ndim] = 1
        assert t[(0,) * t.dim()].item() == 1


@pytest.mark.parametrize("path", PATHS)
def test_view_keeps_memory_alive(path):
    t = torch.arange(1000, dtype=torch.bfloat16)
    v = path(t)[10:20]
    del t
    gc.collect()
    junk = [torch.full((1000,), 7.0, dtype=torch.bfloat16) for _ in range(50)]  # reuse freed memory
    np.testing.assert_array_equal(v.astype(np.float32), np.arange(10, 20, dtype=np.float32))
    del junk


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", [(), (0,), (0, 3), (4, 0, 2)])
def test_zero_d_and_zero_size(shape, path):
    t = torch.full(shape, 3.5, dtype=torch.bfloat16)
    v = path(t)
    assert v.shape == shape and v.dtype == BF16
    np.testing.assert_array_equal(v.astype(np.float32), np.full(shape, 3.5, np.float32))
    if shape == ():
        v[()] = 1.5
        assert t.item() == 1.5


def test_many_cycles_do_not_leak_or_crash():
    t = torch.arange(64, dtype=torch.float32)
    tb = t.to(torch.bfloat16)
    for _ in range(3000):
        for view in (host_view(t), host_view(tb), host_view(Exporter(t)), ctypes_path(tb), legacy_ctypes_path(t)):
            assert view[5] == 5
    gc.collect()


# --- numpy arrays as exporters -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [*DTYPES.values()], ids=str)
def test_numpy_arrays_are_viewed_directly(dtype):
    a = np.arange(12).astype(dtype).reshape(3, 4)[:, ::2]
    v = host_view(a)
    assert type(v) is np.ndarray and v.dtype == a.dtype and v.strides == a.strides
    assert np.shares_memory(v, a)
    v[0, 0] = 1
    assert a[0, 0] == 1


def test_numpy_array_through_dlpack_protocol():
    a = np.arange(12.0).reshape(3, 4)[::-1, 1::2]
    e = Exporter(a)
    v = host_view(e)
    assert e.calls == [{"max_version": (1, 0), "stream": None}]
    np.testing.assert_array_equal(v, a)
    assert v.strides == a.strides and np.shares_memory(v, a)
    w = _dlpack._own_consume(a.__dlpack__(max_version=(1, 0)))  # negative strides through ctypes
    np.testing.assert_array_equal(w, a)
    assert w.strides == a.strides and w.ctypes.data == a.ctypes.data


@pytest.mark.parametrize("consume", [lambda a: host_view(Exporter(a)), lambda a: ctypes_path(a)])
def test_read_only_export_gives_read_only_view(consume):
    a = np.arange(6.0)
    a.flags.writeable = False
    v = consume(a)
    assert not v.flags.writeable
    with pytest.raises(ValueError):
        v[0] = 1
    assert not host_view(a).flags.writeable


@pytest.mark.parametrize("consume", [lambda a: host_view(Exporter(a)), ctypes_path, legacy_ctypes_path])
def test_deleter_runs_when_last_view_dies(consume):
    a = np.arange(100.0)
    alive = weakref.ref(a)  # numpy's DLPack manager holds `a` until its deleter runs
    v = consume(a)
    w = v[3:]
    del a, v
    gc.collect()
    assert alive() is not None
    assert w[0] == 3
    del w
    gc.collect()
    assert alive() is None


def test_unsupported_numpy_dtype_and_non_exporters():
    with pytest.raises(TypeError, match=">f2"):
        host_view(np.zeros(2, ">f2"))
    with pytest.raises(TypeError, match="not a DLPack exporter"):
        host_view([1, 2])


def test_torch_refusals_and_unsupported_torch_dtype():
    with pytest.raises(BufferError, match="gradient"):
        host_view(torch.ones(2, requires_grad=True))
    with pytest.raises(BufferError, match="conjugate"):
        host_view(torch.ones(2, dtype=torch.complex64).conj())
    with pytest.raises(TypeError, match=r"float8_e4m3fn \(code=10, bits=8, lanes=1\)"):
        host_view(torch.zeros(2, dtype=torch.float8_e4m3fn))


def test_device_of():
    assert device_of(torch.zeros(1)) == (1, 0)
    assert device_of(np.zeros(1)) == (1, 0)
    assert device_of(Producer(np.zeros(1), device=(2, 3))) == (2, 3)


# --- a hand-built producer: every DLPack field under control, deleter calls counted ------------------------------


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device_type", ctypes.c_int32),
        ("device_id", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("code", ctypes.c_uint8),
        ("bits", ctypes.c_uint8),
        ("lanes", ctypes.c_uint16),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("byte_offset", ctypes.c_uint64),
    ]


class Versioned(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint32),
        ("minor", ctypes.c_uint32),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("tensor", DLTensor),
    ]


class Legacy(ctypes.Structure):
    _fields_ = [("tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_api = ctypes.pythonapi
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", _api)
)
# The destructor gets a dying object: pass it on as a raw pointer, never as a py_object.
_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(("PyCapsule_IsValid", _api))
_raw_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(("PyCapsule_GetPointer", _api))
CODES = {"i": 0, "u": 1, "f": 2, "V": 4, "c": 5, "b": 6}


class Producer:
    """Exports a numpy array's memory through ctypes-built DLManagedTensor(Versioned) capsules."""

    live: ClassVar[dict[int, tuple]] = {}  # managed address -> everything the export must keep alive
    deletes: ClassVar[dict[int, int]] = {}  # managed address -> deleter calls

    def __init__(self, array, *, device=(1, 0), dtype=None, flags=0, byte_offset=0, strides=True, major=1):
        self.array, self.device, self.flags, self.major = array, device, flags, major
        self.dtype = dtype or (CODES[array.dtype.kind], 8 * array.dtype.itemsize, 1)
        self.byte_offset, self.with_strides = byte_offset, strides
        self.exports = []

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        assert stream is None
        versioned = max_version is not None and max_version[0] >= 1
        managed = Versioned() if versioned else Legacy()
        a, size = self.array, self.array.dtype.itemsize
        shape = (ctypes.c_int64 * max(a.ndim, 1))(*a.shape)
        strides = (ctypes.c_int64 * max(a.ndim, 1))(*(s // size for s in a.strides))
        t = managed.tensor
        t.data = a.ctypes.data - self.byte_offset
        t.byte_offset = self.byte_offset
        t.device_type, t.device_id = self.device
        t.ndim = a.ndim
        t.code, t.bits, t.lanes = self.dtype
        t.shape = ctypes.addressof(shape)
        t.strides = ctypes.addressof(strides) if self.with_strides else None
        if versioned:
            managed.major, managed.minor, managed.flags = self.major, 0, self.flags
        managed.deleter = ctypes.cast(_DELETER, ctypes.c_void_p).value
        address = ctypes.addressof(managed)
        Producer.live[address] = (managed, shape, strides, a)
        Producer.deletes[address] = 0
        self.exports.append(address)
        name = b"dltensor_versioned" if versioned else b"dltensor"
        return _capsule_new(address, name, ctypes.cast(_CAPSULE_DESTRUCTOR, ctypes.c_void_p).value)

    def deleted(self):
        """Deleter calls per export so far."""
        return [Producer.deletes[address] for address in self.exports]


class LegacyProducer(Producer):
    """A pre-1.0 producer: its __dlpack__ takes no max_version."""

    def __dlpack__(self, stream=None):
        return super().__dlpack__(stream=stream)


@ctypes.PYFUNCTYPE(None, ctypes.c_void_p)
def _DELETER(address):
    Producer.deletes[address] += 1
    Producer.live.pop(address)


@ctypes.PYFUNCTYPE(None, ctypes.c_void_p)
def _CAPSULE_DESTRUCTOR(capsule):
    for name in (b"dltensor_versioned", b"dltensor"):  # unconsumed: the producer still owns it
        if _is_valid(capsule, name):
            _DELETER(_raw_pointer(capsule, name))


def bf16(values):
    return np.asarray(values, dtype=np.float32).astype(BF16)


@pytest.mark.parametrize("producer", [Producer, LegacyProducer])
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.bool_, np.complex128], ids=str)
def test_producer_deleter_runs_exactly_once(dtype, producer):
    a = np.arange(24).astype(dtype).reshape(4, 6)
    p = producer(a[1:, ::2])
    v = host_view(p)[1:]
    np.testing.assert_array_equal(v, a[2:, ::2])
    v[0, 0] = a[0, 1]
    assert a[2, 0] == a[0, 1]
    gc.collect()
    assert p.deleted() == [0]
    del v
    gc.collect()
    assert p.deleted() == [1]


def test_producer_many_cycles():
    p = Producer(bf16(range(10)))
    for _ in range(2000):
        assert host_view(p)[4] == 4
    gc.collect()
    assert set(p.deleted()) == {1}


@pytest.mark.parametrize("producer", [Producer, LegacyProducer])
def test_producer_byte_offset_and_null_strides(producer):
    a = bf16(np.arange(12).reshape(3, 4))
    v = host_view(producer(a[1:], byte_offset=8, strides=False))
    np.testing.assert_array_equal(v, a[1:])
    assert v.ctypes.data == a[1:].ctypes.data and v.flags.c_contiguous


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=str)
def test_producer_read_only_flag_and_host_pinned(dtype):
    a = np.arange(4).astype(dtype)
    v = host_view(Producer(a, flags=1, device=(3, 0)))  # DLPACK_FLAG_BITMASK_READ_ONLY, kDLCUDAHost
    assert not v.flags.writeable
    np.testing.assert_array_equal(v, a)
    assert host_view(Producer(a, device=(3, 0))).flags.writeable


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=str)
def test_producer_negative_strides(dtype):
    a = np.arange(12).astype(dtype).reshape(3, 4)[::-1, ::-2]
    v = host_view(Producer(a))
    np.testing.assert_array_equal(v, a)
    assert v.strides == a.strides and v.ctypes.data == a.ctypes.data


def test_device_tensor_is_refused_before_export():
    p = Producer(np.zeros(3, np.float32), device=(2, 0))
    with pytest.raises(TypeError, match=r"CUDA device 0 .*host_view needs host"):
        host_view(p)
    assert p.exports == []


@pytest.mark.parametrize("dtype", [np.float32, BF16], ids=str)
def test_capsule_on_device_is_refused_and_freed(dtype):
    p = Producer(np.zeros(3, dtype), device=(2, 1))
    p.__dlpack_device__ = lambda: (1, 0)  # a producer that lies: the capsule itself is checked
    with pytest.raises(TypeError, match="CUDA device 1"):
        host_view(p)
    gc.collect()
    assert p.deleted() == [1]


@pytest.mark.parametrize(
    ("dl_dtype", "message"),
    [
        ((2, 32, 4), r"vector DLPack dtype float32x4 \(code=2, bits=32, lanes=4\)"),
        ((2, 8, 1), r"DLPack dtype float8 \(code=2, bits=8, lanes=1\)"),
        ((10, 8, 1), r"float8_e4m3fn"),
        ((99, 8, 1), r"unknown \(code=99"),
    ],
)
def test_unsupported_dlpack_dtype(dl_dtype, message):
    p = Producer(np.zeros(4, np.uint8), dtype=dl_dtype)
    with pytest.raises(TypeError, match=message):
        host_view(p)
    gc.collect()
    assert p.deleted() == [1]


def test_unsupported_major_version():
    p = Producer(np.zeros(4, BF16), major=2)
    with pytest.raises(BufferError, match="version"):
        host_view(p)
    gc.collect()
    assert p.deleted() == [1]
