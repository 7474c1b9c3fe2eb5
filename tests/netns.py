"""Two network namespaces joined by a veth pair: two "hosts" on one machine (root only)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def two_namespaces(prefix: str, subnet: int) -> Iterator[tuple[str, str, str]]:
    """Namespaces ``(a, b)`` at 10.77.<subnet>.1 and .2, and a's end of the link; skips without root."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces")
    tag = f"{os.getpid() % 100000}"
    a, b, dev_a, dev_b = f"{prefix}a{tag}", f"{prefix}b{tag}", f"{prefix}va{tag}", f"{prefix}vb{tag}"
    try:
        ip("netns", "add", a)
        ip("netns", "add", b)
        ip("link", "add", dev_a, "type", "veth", "peer", "name", dev_b)
    except (subprocess.CalledProcessError, OSError) as e:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {getattr(e, 'stderr', e)!r}")
    try:
        for ns, dev, host in ((a, dev_a, 1), (b, dev_b, 2)):
            ip("link", "set", dev, "netns", ns)
            ip("-n", ns, "addr", "add", f"10.77.{subnet}.{host}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield a, b, dev_a
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
