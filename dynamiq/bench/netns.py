"""An emulated bandwidth-limited cluster on one Linux machine (docs/design.md, "Measures").

:class:`EmulatedCluster` gives each of ``n`` ranks its own network namespace with one
interface, joined through a bridge, and shapes every link with ``tc`` to a set rate (and
delay where the kernel has ``netem``), in both directions, like a full-duplex NIC::

       rank 0 (ns …-r0)           rank 1 (ns …-r1)                rank n-1
     lo, veth0 10.a.b.1/24      lo, veth0 10.a.b.2/24        veth0 10.a.b.n/24
            │ egress shaped            │                             │
            │ (upload)                 │                             │
     ┌──────┴──────────────────────────┴─────────────────────────────┴──────┐
     │  p0  (egress shaped: download)   p1   ...                     pn-1   │
     │                         br0 (bridge)              hub ns …-h        │
     └────────────────────────────────────────────────────────────────────┘

Everything lives inside namespaces the cluster creates: the bridge sits in a hub namespace of
its own and the veth pairs are created directly between the hub and the rank namespaces, so
no interface of the host (or of another cluster) is ever touched and concurrent clusters
cannot clash. Names carry the process id and a counter; the cluster is removed on exit from
the ``with`` block (also after an exception), on SIGINT/SIGTERM while it is active, and at
interpreter exit; processes still running in its namespaces are killed first. A cluster
left behind by a process that was killed outright (SIGKILL) is removed by the next cluster
created on the machine (its owner's process id no longer exists).

Rate shaping: ``netem`` (rate and delay) where the kernel has it, otherwise ``tbf`` (rate
only; the delay is then *not* applied, and :attr:`EmulatedCluster.shaping` says so and why).

>>> check_available()  # doctest: +SKIP
>>> with EmulatedCluster(2, rate="100mbit") as cl:  # doctest: +SKIP
...     p = cl.popen(1, ["ping", "-c", "1", cl.addresses[0]])
...     p.wait()
0
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from types import FrameType, TracebackType
from typing import Any

__all__ = [
    "IFNAME",
    "EmulatedCluster",
    "NamespaceUnavailable",
    "check_available",
    "interface_counters",
    "parse_rate",
]

#: the name of each rank's interface inside its namespace
IFNAME = "veth0"
_HUB_BRIDGE = "br0"
_COUNTER = itertools.count()
_COUNTER_LOCK = threading.Lock()
_DEFAULT_NAME = re.compile(r"^dq(\d+)-(\d+)-(h|r\d+)$")
_NAME_OK = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,23}$")
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)\s*$", re.IGNORECASE)
_RATE_SCALE = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_SYSCTL_KEY = re.compile(r"^net\.[a-z0-9_]+(\.[a-z0-9_]+)+$")
_SYSCTL_VALUE = re.compile(r"^[A-Za-z0-9_. -]{1,64}$")
_TCP_KEYS = ("net.ipv4.tcp_congestion_control", "net.ipv4.tcp_slow_start_after_idle")


class NamespaceUnavailable(RuntimeError):
    """Network namespaces (or the tools to build the cluster) are not available here."""


def parse_rate(rate: str) -> int:
    """Bits per second of a ``tc`` rate such as ``"100mbit"`` or ``"1gbit"`` (decimal units).

    >>> parse_rate("100mbit"), parse_rate("1.5gbit")
    (100000000, 1500000000)
    """
    m = _RATE.match(rate) if isinstance(rate, str) else None
    if m is None:
        raise ValueError(
            f"rate must be a number followed by bit, kbit, mbit, gbit or tbit, e.g. '100mbit' "
            f"(got {rate!r})"
        )
    bps = int(float(m.group(1)) * _RATE_SCALE[m.group(2).lower()])
    if bps < 8000:
        raise ValueError(f"rate must be at least 8kbit (got {rate!r})")
    return bps


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NamespaceUnavailable(
            f"`{' '.join(argv)}` failed (exit {proc.returncode}): "
            f"{(proc.stderr or proc.stdout).strip() or 'no message'}"
        )
    return proc


def check_available() -> None:
    """Raise :class:`NamespaceUnavailable` (with the reason) unless this process can build an
    :class:`EmulatedCluster`: Linux, root, ``ip`` and ``tc`` on PATH, and a kernel that lets
    it create a network namespace, a bridge, a veth pair and a ``tbf`` or ``netem`` qdisc."""
    if not os.path.exists("/proc/self/ns/net"):
        raise NamespaceUnavailable("network namespaces need Linux (/proc/self/ns/net missing)")
    if os.geteuid() != 0:
        raise NamespaceUnavailable(
            "creating network namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN); "
            f"this process runs as uid {os.geteuid()}"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NamespaceUnavailable(f"`{tool}` (iproute2) is not on PATH")
    probe = f"dqprobe{os.getpid()}-{_next_id()}"
    try:
        _run(["ip", "netns", "add", probe])
    except NamespaceUnavailable as exc:
        raise NamespaceUnavailable(f"the kernel refused a network namespace: {exc}") from None
    try:
        _run(["ip", "-n", probe, "link", "add", "b0", "type", "bridge"])
        _run(["ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1"])
        _run(["ip", "-n", probe, "link", "set", "v0", "up"])
        kinds = []
        for kind in (
            ["netem", "rate", "100mbit"],
            ["tbf", "rate", "100mbit", "burst", "64kb", "limit", "1mb"],
        ):
            ok = _run(["tc", "-n", probe, "qdisc", "add", "dev", "v0", "root", *kind], False)
            if ok.returncode == 0:
                kinds.append(kind[0])
                _run(["tc", "-n", probe, "qdisc", "del", "dev", "v0", "root"], False)
        if not kinds:
            raise NamespaceUnavailable("the kernel has neither the netem nor the tbf qdisc")
    except NamespaceUnavailable as exc:
        raise NamespaceUnavailable(f"cannot build an emulated link: {exc}") from None
    finally:
        _run(["ip", "netns", "del", probe], False)


def _next_id() -> int:
    with _COUNTER_LOCK:
        return next(_COUNTER)


def interface_counters(ifname: str = IFNAME) -> dict[str, int]:
    """``tx_bytes``, ``rx_bytes``, ``tx_packets``, ``rx_packets`` of ``ifname`` as the kernel
    counts them, read from ``/sys/class/net`` of the calling process's namespace (a process
    started by :meth:`EmulatedCluster.popen` sees its own rank's interface)."""
    base = f"/sys/class/net/{ifname}/statistics"
    out = {}
    for key in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"):
        with open(f"{base}/{key}") as f:
            out[key] = int(f.read())
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _list_namespaces() -> list[str]:
    proc = _run(["ip", "netns", "list"], False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _remove_stale() -> None:
    """Delete clusters left by dead processes (default names only: ``dq<pid>-<k>-…``)."""
    for ns in _list_namespaces():
        m = _DEFAULT_NAME.match(ns)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            _kill_namespace_pids(ns)
            _run(["ip", "netns", "del", ns], False)


def _kill_namespace_pids(ns: str, grace: float = 2.0) -> None:
    def pids() -> list[int]:
        proc = _run(["ip", "netns", "pids", ns], False)
        return [int(p) for p in proc.stdout.split() if p.isdigit() and int(p) != os.getpid()]

    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = pids()
        if not alive:
            return
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and pids():
            time.sleep(0.05)


class EmulatedCluster:
    """``n`` network namespaces joined by a bridge through links shaped to ``rate``.

    ``rate`` is a ``tc`` rate (``"100mbit"``, ``"1gbit"``); every rank's upload (egress of
    its ``veth0``) and download (egress of the bridge's port towards it) are each limited to
    it. ``delay_ms`` is added per direction with ``netem`` where the kernel has it (not with
    the ``tbf`` fallback: see :attr:`shaping`). ``name`` (letters, digits, ``_.-``, at most 24
    characters) replaces the default unique prefix ``dq<pid>-<k>``. ``sysctls`` (``net.*``
    keys, e.g. ``{"net.ipv4.tcp_slow_start_after_idle": "0"}``) are set in every rank's
    namespace; otherwise the ranks get the kernel's defaults for a new namespace (recorded in
    ``shaping["tcp"]``).

    Attributes, valid inside the ``with`` block: :attr:`addresses` (IPv4 address of rank
    ``i``, in a private /24 of its own), :attr:`namespaces`, :attr:`ifname` (``veth0``: the
    same in every namespace), :attr:`shaping` (what was applied).
    """

    def __init__(
        self,
        n: int = 4,
        rate: str = "100mbit",
        delay_ms: float = 0.1,
        *,
        name: str | None = None,
        sysctls: dict[str, str] | None = None,
    ) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 250:
            raise ValueError(f"n must be an int in 1..250 (got {n!r})")
        self.rate_bps = parse_rate(rate)
        if not isinstance(delay_ms, (int, float)) or not 0 <= delay_ms <= 10_000:
            raise ValueError(f"delay_ms must be a number in 0..10000 (got {delay_ms!r})")
        k = _next_id()
        if name is None:
            name = f"dq{os.getpid()}-{k}"
        elif not isinstance(name, str) or not _NAME_OK.match(name):
            raise ValueError(
                f"name must be 1-24 characters of letters, digits, '_', '.', '-' (got {name!r})"
            )
        self.sysctls: dict[str, str] = {}
        for key, value in (sysctls or {}).items():
            value = str(value)
            if not (isinstance(key, str) and _SYSCTL_KEY.match(key)):
                raise ValueError(
                    f"sysctls keys must be net.* names, e.g. net.ipv4.tcp_mtu_probing (got {key!r})"
                )
            if not _SYSCTL_VALUE.match(value):
                raise ValueError(
                    f"sysctl value of {key} must be a plain word or number (got {value!r})"
                )
            self.sysctls[key] = value
        self.n = n
        self.rate = rate.strip().lower()
        self.delay_ms = float(delay_ms)
        self.name = name
        self.ifname = IFNAME
        self.hub = f"{name}-h"
        self.namespaces: list[str] = [f"{name}-r{i}" for i in range(n)]
        # a private /24 per cluster (isolated anyway: nothing is routed outside the hub)
        tag = (os.getpid() * 64 + k) % 65024
        self.subnet = f"10.{200 + tag // 256 % 55}.{tag % 256}.0/24"
        prefix = self.subnet.rsplit(".", 1)[0]
        self.addresses: list[str] = [f"{prefix}.{i + 1}" for i in range(n)]
        self.shaping: dict[str, Any] = {}
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._active = False
        self._lock = threading.Lock()
        self._old_handlers: dict[int, Any] = {}

    def __repr__(self) -> str:
        extra = f", sysctls={self.sysctls!r}" if self.sysctls else ""
        return (
            f"EmulatedCluster(n={self.n}, rate={self.rate!r}, delay_ms={self.delay_ms}, "
            f"name={self.name!r}{extra})"
        )

    # -- life cycle ---------------------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        check_available()
        _remove_stale()
        existing = set(_list_namespaces())
        clash = [ns for ns in [self.hub, *self.namespaces] if ns in existing]
        if clash:
            raise NamespaceUnavailable(f"network namespace {clash[0]!r} already exists")
        self._active = True
        atexit.register(self.close)
        self._install_signal_handlers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Kill what runs in the namespaces and delete them (idempotent)."""
        with self._lock:
            if not self._active:
                return
            self._active = False
        for p in self._procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.terminate()
        for p in self._procs:
            try:
                p.wait(timeout=2)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for ns in reversed(self._created):
            _kill_namespace_pids(ns)
            _run(["ip", "netns", "del", ns], False)
        self._created.clear()
        self._restore_signal_handlers()
        atexit.unregister(self.close)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) != signal.SIG_IGN:  # an ignored signal stays ignored
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        old = self._old_handlers.get(signum, signal.SIG_DFL)
        self.close()  # restores the previous handlers
        if callable(old):
            old(signum, frame)
        elif old == signal.SIG_DFL:
            os.kill(os.getpid(), signum)  # the default action, now that we are clean

    # -- building -----------------------------------------------------------------------------

    def _ns_add(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns])
        self._created.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _build(self) -> None:
        hub = self.hub
        self._ns_add(hub)
        _run(["ip", "-n", hub, "link", "add", _HUB_BRIDGE, "type", "bridge"])
        _run(["ip", "-n", hub, "link", "set", _HUB_BRIDGE, "up"])
        for i, ns in enumerate(self.namespaces):
            self._ns_add(ns)
            port = f"p{i}"
            veth = ["type", "veth", "peer", "name", self.ifname, "netns", ns]
            _run(["ip", "-n", hub, "link", "add", port, *veth])
            _run(["ip", "-n", hub, "link", "set", port, "master", _HUB_BRIDGE])
            _run(["ip", "-n", hub, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", self.ifname])
            _run(["ip", "-n", ns, "link", "set", self.ifname, "up"])
            for key, value in self.sysctls.items():
                _run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={value}"])
            self._shape(ns, self.ifname)  # rank i's upload
            self._shape(hub, port)  # rank i's download
        self.shaping.setdefault("rate", self.rate)
        self.shaping["rate_bps"] = self.rate_bps
        self.shaping["links"] = 2 * self.n
        # the TCP the ranks get (the namespace's own settings: kernel defaults unless changed)
        tcp = {}
        for key in _TCP_KEYS:
            path = "/proc/sys/" + key.replace(".", "/")
            proc = _run(["ip", "netns", "exec", self.namespaces[0], "cat", path], False)
            tcp[key] = proc.stdout.strip() if proc.returncode == 0 else None
        self.shaping["tcp"] = tcp

    def _shape(self, ns: str, dev: str) -> None:
        rate_bytes = self.rate_bps / 8
        # the bucket holds a whole GSO packet (64 KiB, so tbf never has to split one) and at
        # least 2 ms at the rate; the queue holds 50 ms at the rate (>= 1 MiB)
        burst = max(96 * 1024, int(rate_bytes * 0.002))
        limit = max(1 << 20, int(rate_bytes * 0.05))
        kind = self.shaping.get("qdisc")
        if kind in (None, "netem"):
            pkts = max(1000, limit // 1500)
            netem = ["netem", "delay", f"{self.delay_ms}ms", "rate", self.rate, "limit", str(pkts)]
            proc = _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *netem], False)
            if proc.returncode == 0:
                self.shaping.update(qdisc="netem", delay_ms=self.delay_ms, delay_applied=True)
                return
            if kind == "netem":
                raise NamespaceUnavailable(f"tc netem failed on {dev}: {proc.stderr.strip()}")
            why = (proc.stderr or proc.stdout).strip().splitlines()
            self.shaping.update(
                qdisc="tbf",
                delay_ms=0.0,
                delay_applied=False,
                delay_not_applied_because=(
                    f"netem is not available in this kernel ({why[0] if why else 'no message'}); "
                    f"tbf shapes the rate only, so the {self.delay_ms:g} ms delay is missing"
                ),
            )
        tbf = ["tbf", "rate", self.rate, "burst", str(burst), "limit", str(limit)]
        _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf])
        self.shaping.update(burst_bytes=burst, queue_limit_bytes=limit)

    # -- using --------------------------------------------------------------------------------

    def _check_rank(self, i: int) -> None:
        if not self._active:
            raise RuntimeError("the cluster is not active: use it inside its `with` block")
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n:
            raise ValueError(f"rank must be an int in 0..{self.n - 1} (got {i!r})")

    def popen(
        self, i: int, argv: list[str], env: dict[str, str] | None = None, **kw: Any
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` inside rank ``i``'s namespace (``ip netns exec``).

        The environment is this process's, plus ``GLOO_SOCKET_IFNAME=veth0`` (so gloo binds
        to the shaped link), plus ``env``. Other keyword arguments go to
        :class:`subprocess.Popen`. The process is killed when the cluster is removed.
        """
        self._check_rank(i)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError(f"argv must be a non-empty list of strings (got {argv!r})")
        full_env = dict(os.environ)
        full_env["GLOO_SOCKET_IFNAME"] = self.ifname
        full_env.update(env or {})
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.namespaces[i], *argv], env=full_env, **kw
        )
        self._procs.append(proc)
        return proc

    def counters(self) -> list[dict[str, int]]:
        """Per rank, the kernel's counters of its ``veth0``: ``tx_bytes``, ``rx_bytes``,
        ``tx_packets``, ``rx_packets`` (cumulative since the cluster was built; link-layer
        bytes: payload plus TCP/IP/Ethernet headers, ACKs and ARP)."""
        if not self._active:
            raise RuntimeError("the cluster is not active: use it inside its `with` block")
        out = []
        for ns in self.namespaces:
            proc = _run(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", self.ifname])
            stats = json.loads(proc.stdout)[0]["stats64"]
            out.append(
                {
                    "tx_bytes": int(stats["tx"]["bytes"]),
                    "rx_bytes": int(stats["rx"]["bytes"]),
                    "tx_packets": int(stats["tx"]["packets"]),
                    "rx_packets": int(stats["rx"]["packets"]),
                }
            )
        return out
