"""`own_network()`: the test process's main thread, and what it starts, in a network namespace of its own for a
`with` block. A census of this machine counts only the processes of its own network namespace
(preflight.node.census), so inside the block it sees the test's own rank and launcher, never another test run's or
a developer's torchrun on the same machine. Needs root (unshare(2), setns(2)); without it the block runs as is."""
import contextlib
import ctypes
import os
import subprocess

CLONE_NEWNET = 0x40000000  # <linux/sched.h>


@contextlib.contextmanager
def own_network():
    if os.geteuid() != 0:
        yield  # no namespace: another job on this machine may be counted in the test's census
        return
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/thread-self/ns/net") as home:
        if libc.unshare(CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")
        try:
            subprocess.run(["ip", "link", "set", "lo", "up"], check=True)  # a new namespace's loopback is down
            yield
        finally:
            if libc.setns(home.fileno(), CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the test run's network namespace")
