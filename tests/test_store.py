"""commlib.store: TCPStore, FileStore and PrefixStore over real sockets, files and processes (no mocks)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ports import free_port
from reference import search_settings

from commlib.errors import CommError, CommTimeoutError
from commlib.store import FileStore, PrefixStore, Store, StoreTokenError, TCPStore
from commlib.store._wire import HEADER, MAGIC, VERSION, Op, Status, encode, pack_int

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
Peer = Callable[[], Store]
S = TypeVar("S", bound=Store)


def _python(script: str, *args: object) -> subprocess.Popen[bytes]:
    """Start ``python -c script args...`` with this checkout importable."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], env=env)


@pytest.fixture
def master() -> Iterator[TCPStore]:
    with TCPStore(HOST, 0, is_master=True, timeout=10) as store:
        yield store


@pytest.fixture(params=["tcp", "file", "prefix-tcp", "prefix-file"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Store, Peer]]:
    """A store plus a factory for another instance sharing its data (another client / process view)."""
    opened: list[Store] = []

    def track(store: S) -> S:
        opened.append(store)
        return store

    kind = request.param
    if kind.endswith("tcp"):
        master = track(TCPStore(HOST, 0, is_master=True, timeout=10))
        base: Peer = lambda: track(TCPStore(HOST, master.port, timeout=10))  # noqa: E731
    else:
        path = tmp_path / "store"
        base = lambda: track(FileStore(path))  # noqa: E731
    peer = (lambda: PrefixStore("pre", base())) if kind.startswith("prefix") else base
    yield peer(), peer
    for store in reversed(opened):
        store.close()


# -- the Store methods, on every store ---------------------------------------------------------------------------


def test_set_get_roundtrip(stores: tuple[Store, Peer]) -> None:
    store, peer = stores
    store.set("bytes", b"\x00\xffbinary")
    store.set("text", "héllo")
    store.set("empty", b"")
    other = peer()
    assert other.get("bytes") == b"\x00\xffbinary"
    assert other.get("text") == "héllo".encode()
    assert other.get("empty") == b""
    store.set("text", "replaced")
    assert other.get("text") == b"replaced"


def test_add_is_decimal_ascii(stores: tuple[Store, Peer]) -> None:
    store, peer = stores
    assert store.add("n", 5) == 5
    assert peer().add("n", -7) == -2
    assert store.get("n") == b"-2"
    store.set("word", "abc")
    with pytest.raises(ValueError, match="word"):
        store.add("word", 1)


def test_compare_set(stores: tuple[Store, Peer]) -> None:
    store, _ = stores
    assert store.compare_set("k", "", "first") == b"first"  # missing key + empty expectation: set it
    assert store.compare_set("k", "wrong", "x") == b"first"  # mismatch: current value, unchanged
    assert store.compare_set("k", "first", b"second") == b"second"  # match: swapped
    assert store.get("k") == b"second"
    assert store.compare_set("absent", "e", "d") == b"e"  # torch: missing key + non-empty expectation
    assert not store.check(["absent"])


def test_delete_and_num_keys(stores: tuple[Store, Peer]) -> None:
    store, _ = stores
    assert store.num_keys() == 0
    store.set("a", "1")
    store.add("b", 1)
    assert store.num_keys() == 2
    assert store.delete_key("a") is True
    assert store.delete_key("a") is False
    assert store.num_keys() == 1
    assert not store.check(["a"])


def test_check_and_wait(stores: tuple[Store, Peer]) -> None:
    store, _ = stores
    assert store.check([])
    store.wait([])
    store.set("x", "1")
    assert store.check(["x"])
    assert not store.check(["x", "y"])
    store.wait(["x"], timedelta(seconds=1))
    with pytest.raises(TypeError):
        store.check("x")  # a str is not a list of keys
    started = time.monotonic()
    with pytest.raises(CommTimeoutError, match="missing-key"):
        store.wait(["x", "missing-key"], 0.2)
    assert time.monotonic() - started < 3


def test_get_waits_for_a_later_set_from_another_thread(stores: tuple[Store, Peer]) -> None:
    store, peer = stores
    other = peer()
    timer = threading.Timer(0.2, other.set, ("late", "arrived"))
    timer.start()
    assert store.get("late") == b"arrived"
    store.wait(["late"])
    timer.join()


def test_get_timeout_names_the_key(stores: tuple[Store, Peer]) -> None:
    store, _ = stores
    store.set_timeout(0.2)
    assert store.timeout == timedelta(seconds=0.2)
    with pytest.raises(CommTimeoutError, match="never-set"):
        store.get("never-set")
    store.set_timeout(timedelta(seconds=5))
    assert store.timeout == timedelta(seconds=5)
    with pytest.raises(ValueError):
        store.set_timeout(-1)


def test_prefix_store_prefixes_keys(master: TCPStore) -> None:
    prefixed = PrefixStore("job", master)
    prefixed.set("k", "v")
    assert master.get("job/k") == b"v"
    assert prefixed.underlying_store is master
    assert PrefixStore("outer", prefixed).add("n", 2) == 2
    assert master.check(["job/outer/n"])


# -- TCPStore ------------------------------------------------------------------------------------------------------


def test_master_port_zero_picks_a_port(master: TCPStore) -> None:
    assert master.port > 0
    assert master.host == HOST
    with pytest.raises(ValueError, match="port"):
        TCPStore(HOST, 0, timeout=1)
    with pytest.raises(CommError, match=f"{HOST}:{master.port}"):
        TCPStore(HOST, master.port, is_master=True, timeout=1)  # the port is taken


def test_master_can_serve_a_socket_it_is_given() -> None:
    with socket.create_server((HOST, 0)) as listener:
        master = TCPStore(HOST, 0, is_master=True, timeout=5, master_listen_fd=listener.fileno())
        with master, TCPStore(HOST, master.port, timeout=5) as client:
            assert master.port == listener.getsockname()[1]
            master.set("k", "v")
            assert client.get("k") == b"v"


def test_client_retries_until_the_server_starts() -> None:
    port = free_port(HOST)
    result: list[bytes] = []

    def client() -> None:
        with TCPStore(HOST, port, timeout=10) as store:
            result.append(store.get("hello"))

    thread = threading.Thread(target=client)
    thread.start()
    time.sleep(0.3)
    with TCPStore(HOST, port, is_master=True, timeout=10) as master:
        master.set("hello", "world")
        thread.join(10)
    assert result == [b"world"]


def test_client_times_out_naming_host_and_port() -> None:
    port = free_port(HOST)
    started = time.monotonic()
    with pytest.raises(CommTimeoutError, match=f"{HOST}:{port}"):
        TCPStore(HOST, port, timeout=0.3)
    assert time.monotonic() - started < 3


def test_wait_for_workers() -> None:
    port = free_port(HOST)
    masters: list[TCPStore] = []
    thread = threading.Thread(target=lambda: masters.append(TCPStore(HOST, port, 3, True, timeout=10)))
    thread.start()
    with TCPStore(HOST, port, timeout=10), TCPStore(HOST, port, timeout=10):
        thread.join(10)
        assert len(masters) == 1
    masters[0].close()
    with pytest.raises(CommTimeoutError, match="1 of 2"):
        TCPStore(HOST, 0, world_size=2, is_master=True, timeout=0.3)


def test_token_is_required_and_checked() -> None:
    with TCPStore(HOST, 0, is_master=True, timeout=5, token=b"s3cret") as master:
        for bad in (None, "wrong", b"s3cre"):
            with pytest.raises(StoreTokenError, match="store token rejected"):
                TCPStore(HOST, master.port, timeout=5, token=bad)
        assert issubclass(StoreTokenError, CommError)
        with TCPStore(HOST, master.port, timeout=5, token="s3cret") as client:
            client.set("k", "v")
            assert master.get("k") == b"v"


def test_parked_get_does_not_block_other_clients(master: TCPStore) -> None:
    outcome: list[BaseException] = []

    def park(store: TCPStore) -> None:
        try:
            store.get("never")
        except CommTimeoutError as exc:
            outcome.append(exc)

    with TCPStore(HOST, master.port, timeout=1.5) as waiter:
        thread = threading.Thread(target=park, args=(waiter,))
        thread.start()
        time.sleep(0.1)
        for i in range(50):
            master.set(f"k{i}", str(i))
            assert master.get(f"k{i}") == str(i).encode()
        assert thread.is_alive()  # all served while the other client is still parked
        thread.join(5)
    assert len(outcome) == 1 and "never" in str(outcome[0])


def test_size_limits_and_large_values() -> None:
    with TCPStore(HOST, 0, is_master=True, timeout=10, max_value_size=1 << 21) as master:
        big = os.urandom(1 << 21)
        master.set("big", big)
        assert master.get("big") == big
        with pytest.raises(ValueError, match="exceeds"):
            master.set("too-big", big + b"x")
        with pytest.raises(ValueError, match="exceeds"):
            master.set("k" * 4097, "v")
        assert master.num_keys() == 1


def test_multi_tenant_masters_share_one_server() -> None:
    first = TCPStore(HOST, 0, is_master=True, timeout=5, multi_tenant=True)
    second = TCPStore(HOST, first.port, is_master=True, timeout=5, multi_tenant=True)
    first.set("shared", "yes")
    first.close()
    assert second.get("shared") == b"yes"  # the server lives while any tenant does
    second.close()


def test_closed_store_raises(master: TCPStore) -> None:
    client = TCPStore(HOST, master.port, timeout=5)
    client.close()
    client.close()
    with pytest.raises(CommError, match="closed"):
        client.set("k", "v")


ADD_WORKER = """
import sys, threading
from commlib.store import TCPStore
port, threads, adds, tag = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

def run(i):
    with TCPStore("127.0.0.1", port, timeout=60) as store:
        store.set(f"ready/{tag}/{i}", "1")
        store.get("go")  # parked until the parent process sets it
        for _ in range(adds):
            store.add("total", 1)
        store.set(f"done/{tag}/{i}", "1")

workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
for w in workers:
    w.start()
for w in workers:
    w.join()
"""


def test_64_concurrent_clients_add_exactly(master: TCPStore) -> None:
    """4 processes x 14 threads + 8 threads here = 64 clients, each adding 1000 times after a shared go signal."""
    procs, per_proc, local, adds = 4, 14, 8, 1000
    children = [_python(ADD_WORKER, master.port, per_proc, adds, f"p{p}") for p in range(procs)]
    seen: list[list[int]] = [[] for _ in range(local)]
    tags = [(f"p{p}", i) for p in range(procs) for i in range(per_proc)] + [("local", i) for i in range(local)]

    def run(i: int) -> None:
        with TCPStore(HOST, master.port, timeout=60) as store:
            store.set(f"ready/local/{i}", "1")
            store.get("go")
            seen[i] = [store.add("total", 1) for _ in range(adds)]
            store.set(f"done/local/{i}", "1")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(local)]
    for t in threads:
        t.start()
    master.wait([f"ready/{tag}/{i}" for tag, i in tags], 60)
    started = time.perf_counter()
    master.set("go", "1")  # wakes all 64 clients, parked in get("go") in four other processes and here
    master.wait([f"done/{tag}/{i}" for tag, i in tags], 60)
    elapsed = time.perf_counter() - started
    for t in threads:
        t.join(10)
    assert [child.wait(30) for child in children] == [0] * procs
    total = procs * per_proc * adds + local * adds
    assert master.get("total") == str(total).encode()
    results = [v for vs in seen for v in vs]
    assert len(set(results)) == len(results)  # atomic: no two adds saw the same running total
    print(f"\n64 clients: {total} adds in {elapsed:.2f}s = {total / elapsed:,.0f} adds/s")


# -- hostile bytes -------------------------------------------------------------------------------------------------

TOKEN = b"fuzz-token"
MAX_KEY, MAX_VALUE = 64, 256  # small limits, so frames over them are cheap to send
_valid = st.sampled_from(
    [
        encode(Op.SET, [b"fuzz/k", b"v"]),
        encode(Op.GET, [b"fuzz/k", pack_int(0)]),
        encode(Op.GET, [b"fuzz/absent", pack_int(50)]),
        encode(Op.ADD, [b"fuzz/n", pack_int(1)]),
        encode(Op.ADD, [b"fuzz/k", pack_int(1)]),
        encode(Op.CAS, [b"fuzz/c", b"", b"x"]),
        encode(Op.WAIT, [pack_int(0), b"fuzz/absent"]),
        encode(Op.CHECK, [b"a", b"b"]),
        encode(Op.DELETE, [b"fuzz/absent"]),
        encode(Op.NUM_KEYS, []),
        encode(Op.HELLO, [TOKEN]),
    ]
)
_header = st.builds(
    lambda magic, version, code, size, body: HEADER.pack(magic, version, code, size) + body,
    st.sampled_from([MAGIC, b"XX"]),
    st.sampled_from([VERSION, 0, 255]),
    st.integers(0, 255),
    st.integers(0, 64),
    st.binary(max_size=64),
)
_oversized = st.one_of(
    st.builds(
        lambda op, size: HEADER.pack(MAGIC, VERSION, op, size), st.sampled_from(list(Op)), st.integers(2**20, 2**32 - 1)
    ),
    st.builds(lambda n: encode(Op.SET, [b"k" * (MAX_KEY + n), b"v"]), st.integers(1, 64)),
    st.builds(lambda n: encode(Op.SET, [b"k", b"v" * (MAX_VALUE + n)]), st.integers(1, 256)),
    st.builds(lambda n: encode(Op.CAS, [b"k", b"", b"v" * (MAX_VALUE + n)]), st.integers(1, 256)),
    st.builds(lambda n: encode(Op.HELLO, [b"t" * (1025 + n)]), st.integers(0, 64)),  # token over MAX_TOKEN
    st.builds(lambda n: encode(Op.WAIT, [pack_int(0), b"k" * (MAX_KEY + n)]), st.integers(1, 64)),
)
FRAMES = {
    "random": st.binary(min_size=1, max_size=96),
    "valid": _valid,
    "bad header": _header,  # bad magic, version or op code; a body shorter or longer than announced
    "truncated": st.tuples(_valid, st.floats(0, 1)).map(lambda vf: vf[0][: max(1, int(len(vf[0]) * vf[1]))]),
    "oversized": _oversized,
    "wrong arity": st.builds(lambda op, n: encode(op, [b"k"] * n), st.sampled_from(list(Op)), st.integers(0, 6)),
}
_frames = st.one_of([st.tuples(st.just(kind), frames) for kind, frames in FRAMES.items()])


class _Fuzzer:
    """Sends frames over raw sockets, reconnecting whenever the server has closed the connection."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock: socket.socket | None = None
        self.sent: dict[str, int] = dict.fromkeys(FRAMES, 0)  # frames the server received, by kind

    def _connect(self, authenticate: bool) -> socket.socket:
        sock = socket.create_connection((HOST, self.port), timeout=5)
        if authenticate:
            sock.sendall(encode(Op.HELLO, [TOKEN]))
            assert sock.recv(HEADER.size)[3] == Status.OK
        sock.setblocking(False)  # a socket with a timeout would wait in recv() even with MSG_DONTWAIT
        return sock

    def send(self, kind: str, frame: bytes, authenticate: bool) -> None:
        if self.sock is None:
            self.sock = self._connect(authenticate)
        try:
            self.sock.sendall(frame)
            self.sent[kind] += 1
            if self.sock.recv(1 << 16) == b"":
                self.close()  # the server hung up on us
        except BlockingIOError:
            pass  # nothing to read yet
        except OSError:
            self.close()  # reset by the server

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _settles(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Whether ``check()`` becomes true within ``timeout`` (the server closes connections asynchronously)."""
    end = time.monotonic() + timeout
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.002)
    return True


def test_fuzzed_frames_never_hurt_the_server() -> None:
    """>= 1000 random, truncated, oversized and otherwise bad frames at a live server, in batches; after each
    batch a well-behaved client is still served correctly and the server holds no leftover connection."""
    threads, fds = threading.active_count(), _open_fds()
    with TCPStore(
        HOST, 0, is_master=True, timeout=10, token=TOKEN, max_key_size=MAX_KEY, max_value_size=MAX_VALUE
    ) as master:
        server = master._server
        assert server is not None
        with TCPStore(HOST, master.port, timeout=5, token=TOKEN) as client:
            baseline = len(server._conns)  # the master's and the client's own connections
            fuzzer, batches = _Fuzzer(master.port), [0]

            @search_settings(250, shrink=True)
            @given(frames=st.lists(_frames, min_size=10, max_size=20), authenticate=st.booleans())
            def batch(frames: list[tuple[str, bytes]], authenticate: bool) -> None:
                for kind, frame in frames:
                    fuzzer.send(kind, frame, authenticate)
                fuzzer.close()
                batches[0] += 1
                key = f"check/{batches[0]}"
                client.set(key, key)
                assert master.get(key) == key.encode() and client.add("check/n", 1) == batches[0]
                assert client.compare_set("check/cas", "", key) == key.encode() and client.delete_key("check/cas")
                assert server.alive
                assert _settles(lambda: len(server._conns) == baseline), (len(server._conns), baseline)
                assert not server._parked, server._parked  # no waiter outlives its connection

            batch()
            print(f"\nfuzz: {sum(fuzzer.sent.values())} frames in {batches[0]} batches: {fuzzer.sent}")
            assert sum(fuzzer.sent.values()) >= 1000, fuzzer.sent
            assert all(count >= 100 for count in fuzzer.sent.values()), fuzzer.sent
            assert fuzzer.sent["random"] + fuzzer.sent["truncated"] + fuzzer.sent["oversized"] >= 1000, fuzzer.sent
            assert client.get(f"check/{batches[0]}") == f"check/{batches[0]}".encode()
            assert threading.active_count() == threads + 1  # the server's one thread, and nothing else
    assert _settles(lambda: threading.active_count() == threads and _open_fds() == fds), (threads, fds)


def test_leak_check_sees_a_connection_left_open(master: TCPStore) -> None:
    """The fuzz test's connection check is not vacuous: a client that stays connected is seen."""
    server = master._server
    assert server is not None
    baseline = len(server._conns)
    with socket.create_connection((HOST, master.port), timeout=5):
        assert _settles(lambda: len(server._conns) == baseline + 1)  # accepted
        assert not _settles(lambda: len(server._conns) == baseline, timeout=0.2)
    assert _settles(lambda: len(server._conns) == baseline)


@pytest.mark.parametrize(
    "frame",
    [
        HEADER.pack(MAGIC, VERSION, Op.SET, 2**32 - 1),  # oversized body
        b"GET / HTTP/1.1\r\n\r\n",  # not our protocol
        encode(Op.SET, [b"k", b"v"]),  # a request before the HELLO
        encode(Op.HELLO, [b""]) + encode(Op.HELLO, [b""]),  # a second HELLO
        encode(Op.HELLO, [b""]) + encode(Op.GET, [b"k", b"short"]),  # an int field that is not 8 bytes
        encode(Op.HELLO, [b""]) + encode(Op.CAS, [b"k", b"v"]),  # too few fields
        encode(Op.HELLO, [b""]) + encode(Op.SET, [b"k" * 4097, b"v"]),  # key over the limit
        encode(Op.HELLO, [b""]) + encode(99, []),  # unknown op
        encode(Op.HELLO, [b""]) + HEADER.pack(MAGIC, VERSION, Op.NUM_KEYS, 3) + b"\0\0\0",  # a cut field header
    ],
)
def test_bad_frame_closes_only_that_connection(master: TCPStore, frame: bytes) -> None:
    with socket.create_connection((HOST, master.port), timeout=5) as raw:
        raw.sendall(frame)
        while reply := raw.recv(1 << 16):  # a valid HELLO first is answered, then the connection is closed
            assert reply.startswith(encode(Status.OK, []))
    master.set("still", "serving")
    assert master.get("still") == b"serving"
    assert master.num_keys() == 1


def test_extreme_wait_timeouts_from_raw_clients(master: TCPStore) -> None:
    """Found by the fuzzer: a GET asking to wait 2**63 ms once overflowed the server's poll()."""
    with socket.create_connection((HOST, master.port), timeout=5) as raw:
        raw.sendall(encode(Op.HELLO, [b""]) + encode(Op.GET, [b"k", pack_int(2**63 - 1)]))
        assert raw.recv(HEADER.size) == encode(Status.OK, [])
        with socket.create_connection((HOST, master.port), timeout=5) as other:
            other.sendall(encode(Op.HELLO, [b""]) + encode(Op.WAIT, [pack_int(-(2**63)), b"k"]))
            assert other.recv(HEADER.size) == encode(Status.OK, [])
            assert other.recv(64) == encode(Status.TIMEOUT, [b"k"])  # a negative timeout: answered at once
        master.set("k", "v")
        assert raw.recv(64) == encode(Status.OK, [b"v"])  # the parked GET is answered when the key arrives
    assert master._server is not None and master._server.alive


# -- FileStore -----------------------------------------------------------------------------------------------------

FILE_WORKER = """
import sys
from commlib.store import FileStore
store = FileStore(sys.argv[1], world_size=2)
store.set("child-ready", "1")
store.get("parent-ready")  # waits for the other process
for _ in range(int(sys.argv[2])):
    store.add("counter", 1)
store.set("child-done", "1")
store.close()
"""


def test_file_store_shared_between_two_processes(tmp_path: Path) -> None:
    path, adds = tmp_path / "shared", 300
    store = FileStore(path, world_size=2)
    child = _python(FILE_WORKER, path, adds)
    store.wait(["child-ready"], 30)
    store.set("parent-ready", "1")  # from here both processes add at once
    for _ in range(adds):
        store.add("counter", 1)
    store.wait(["child-done"], 30)
    assert child.wait(30) == 0
    assert store.get("counter") == str(2 * adds).encode()
    store.close()
    assert not path.exists()  # both of world_size=2 closed: removed, as torch does


def test_file_store_threads_and_persistence(tmp_path: Path) -> None:
    path = tmp_path / "kept"

    def run() -> None:
        with FileStore(path) as store:
            for _ in range(100):
                store.add("n", 1)

    threads = [threading.Thread(target=run) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert path.exists()  # world_size=-1: never removed
    with FileStore(path) as store:
        assert store.get("n") == b"600"
        assert store.num_keys() == 1
