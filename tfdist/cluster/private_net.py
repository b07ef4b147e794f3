"""A private network for a local job: every process in one network namespace that has only loopback.

TensorFlow's gRPC server listens on every interface (`*:PORT`) and has no authentication: whoever
reaches the port can run operations in the worker. A local job needs no interface but loopback, so the
launcher starts its processes inside a network namespace of their own, where loopback is the only
interface: they reach each other on 127.0.0.1, and nothing outside this namespace reaches them
(nor the host's other processes). See docs/security.md.

As root the namespace is a plain network namespace; otherwise a user namespace (mapped to the caller)
holds it, where the kernel allows unprivileged user namespaces. Where neither works the job runs on the
host network with a warning.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator

__all__ = ["PrivateNetwork", "private_network"]


class PrivateNetwork:
    """A network namespace kept alive by a holder process; `command_prefix` runs a command inside it."""

    def __init__(self, holder: subprocess.Popen, unprivileged: bool):
        self.holder, self.unprivileged = holder, unprivileged

    @property
    def command_prefix(self) -> list[str]:
        target = ["nsenter", "-t", str(self.holder.pid)]
        if self.unprivileged:
            return [*target, "--user", "--net", "--preserve-credentials", "--"]
        return [*target, "--net", "--"]

    def close(self) -> None:
        if self.holder.poll() is None:
            self.holder.kill()
        self.holder.wait()


def _missing_tools() -> list[str]:
    return [tool for tool in ("unshare", "nsenter", "ip") if shutil.which(tool) is None]


def _start(unprivileged: bool) -> PrivateNetwork:
    namespaces = ["--user", "--map-root-user", "--net"] if unprivileged else ["--net"]
    holder = subprocess.Popen(["unshare", *namespaces, "sleep", "infinity"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    net = PrivateNetwork(holder, unprivileged)
    deadline = time.monotonic() + 5
    # The holder is in its namespace once its /proc entry points to a different one than ours.
    while holder.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{holder.pid}/ns/net") != os.readlink("/proc/self/ns/net"):
                break
        time.sleep(0.01)
    if holder.poll() is not None:
        raise OSError((holder.stderr.read() or b"").decode(errors="replace").strip() or "unshare failed")
    up = subprocess.run([*net.command_prefix, "ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    if up.returncode != 0:
        net.close()
        raise OSError(up.stderr.strip() or "could not bring loopback up")
    return net


@contextlib.contextmanager
def private_network() -> Iterator[tuple[PrivateNetwork | None, str | None]]:
    """Yields (network, None), or (None, reason) when no private namespace can be made here."""
    missing = _missing_tools()
    if missing:
        yield None, f"{', '.join(missing)} not found (util-linux / iproute2)"
        return
    try:
        net = _start(unprivileged=os.geteuid() != 0)
    except OSError as err:
        yield None, str(err).splitlines()[0] if str(err) else type(err).__name__
        return
    try:
        yield net, None
    finally:
        net.close()
