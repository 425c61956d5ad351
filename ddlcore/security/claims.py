"""What a connecting end claims in the job-key handshake (``ddlcore.security.auth``), and who owns a
socket's other end when it is on this host.

A `Claim` names both ends and the service: which service the connector wants (the rendezvous
store, a TCP channel, a control plane), which start of the job it belongs to (the store's job id, once learned),
its own rank and the rank it wants, the world size, the exact address it dialled, and which
process it is (a random id drawn per process, its pid). The proof of each end covers the whole
claim, so a proof given for one service, one job, one address or one pair of ranks is worth
nothing for another. The acceptor checks the claim before it proves anything (`Acceptor`).

Wire layout (little-endian), at most ``MAX_CLAIM_BYTES``::

    service[8] | job_id[16] | src i32 | dst i32 | size i32 | target_ip[16] | target_port u16
    | instance[16] | pid u32 | origin length u8 | extra length u8 | origin | extra

``target_ip`` is IPv6 (IPv4 as ``::ffff:a.b.c.d``; all zeros for a socket without an IP address,
such as a socketpair in tests). ``origin`` (where the connector's secret came from, for messages
only) and ``extra`` (the service's own fields) are at most 120 and 64 bytes.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import struct
import sys
from dataclasses import dataclass, field, replace

JOB_ID_BYTES = 16
INSTANCE_BYTES = 16
MAX_ORIGIN_BYTES = 120
MAX_EXTRA_BYTES = 64
NO_JOB_ID = bytes(JOB_ID_BYTES)

_FIXED = struct.Struct("<8s16siii16sH16sIBB")
MAX_CLAIM_BYTES = _FIXED.size + MAX_ORIGIN_BYTES + MAX_EXTRA_BYTES

# The services a listener may serve; a claim for another is refused before any proof.
STORE, TCP, CONTROL = "store", "tcp", "control"
_SERVICES = (STORE, TCP, CONTROL)

# This process's id in claims: drawn again in a forked child, which is another process.
_instance = [secrets.token_bytes(INSTANCE_BYTES)]
os.register_at_fork(after_in_child=lambda: _instance.__setitem__(0, secrets.token_bytes(16)))


def instance_id() -> bytes:
    """The random id this process claims (fresh per process, forked children included)."""
    return _instance[0]


@dataclass(frozen=True)
class Claim:
    """A connector's claim: see the module docstring for each field."""

    service: str
    src: int = -1
    dst: int = -1
    size: int = -1
    job_id: bytes = NO_JOB_ID
    target: tuple[str, int] = ("", 0)
    instance: bytes = field(default_factory=instance_id)
    pid: int = field(default_factory=os.getpid)
    origin: str = ""
    extra: bytes = b""

    def encode(self) -> bytes:
        if self.service not in _SERVICES:
            raise ValueError(f"unknown service {self.service!r}")
        origin = self.origin.encode("utf-8", "replace")[:MAX_ORIGIN_BYTES]
        if len(self.extra) > MAX_EXTRA_BYTES:
            raise ValueError(f"extra of {len(self.extra)} bytes (at most {MAX_EXTRA_BYTES})")
        return (
            _FIXED.pack(
                self.service.encode(),
                self.job_id,
                self.src,
                self.dst,
                self.size,
                ip_bytes(self.target[0]),
                self.target[1],
                self.instance,
                self.pid & 0xFFFFFFFF,
                len(origin),
                len(self.extra),
            )
            + origin
            + self.extra
        )

    @classmethod
    def decode(cls, raw: bytes) -> Claim | None:
        """The claim ``raw`` encodes; None if it is not a well-formed claim."""
        if len(raw) < _FIXED.size:
            return None
        fields = _FIXED.unpack_from(raw)
        service_raw, job_id, src, dst, size, ip, port, instance, pid, norigin, nextra = fields
        if len(raw) != _FIXED.size + norigin + nextra or norigin > MAX_ORIGIN_BYTES:
            return None
        service = service_raw.rstrip(b"\0").decode("ascii", "replace")
        if service not in _SERVICES or nextra > MAX_EXTRA_BYTES:
            return None
        origin = raw[_FIXED.size : _FIXED.size + norigin].decode("utf-8", "replace")
        return cls(
            service,
            src,
            dst,
            size,
            bytes(job_id),
            (ip_text(ip), port),
            bytes(instance),
            pid,
            origin,
            bytes(raw[_FIXED.size + norigin :]),
        )

    def aimed_at(self, target: tuple[str, int]) -> Claim:
        return replace(self, target=target)


def ip_bytes(host: str) -> bytes:
    """``host`` (IPv4 or IPv6 text) as 16 bytes of IPv6, IPv4 mapped; zeros for ""."""
    if not host:
        return bytes(16)
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv4Address):
        ip = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + ip.packed)
    return ip.packed


def ip_text(raw: bytes) -> str:
    """The text of 16 bytes made by `ip_bytes`."""
    if raw == bytes(16):
        return ""
    ip = ipaddress.IPv6Address(raw)
    return str(ip.ipv4_mapped) if ip.ipv4_mapped is not None else str(ip)


def endpoint(address: object) -> tuple[str, int]:
    """A socket address as (IP text, port), IPv4-mapped IPv6 as IPv4 and without a scope;
    ("", 0) for an address that is not IP (a Unix socket)."""
    if not isinstance(address, tuple) or len(address) < 2:
        return "", 0
    ip = ipaddress.ip_address(str(address[0]).split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(address[1])


def same_endpoint(a: tuple[str, int], b: tuple[str, int]) -> bool:
    return ip_bytes(a[0]) == ip_bytes(b[0]) and a[1] == b[1]


# --- who is at the other end of a local TCP connection --------------------------------------


def peer_uid(sock: socket.socket) -> int | None:
    """The uid owning the other end of ``sock`` when that end is a TCP socket that a process of
    this host (in this network namespace) still holds open, read from /proc/net/tcp{,6}; None
    when it cannot be told (another host or namespace, not TCP, or the other end closed: a
    closed socket's row, TIME_WAIT, says uid 0 whoever held it, so rows without an inode are
    not believed)."""
    try:
        local, remote = endpoint(sock.getsockname()), endpoint(sock.getpeername())
    except OSError:
        return None
    if not local[0] or not remote[0] or sys.byteorder != "little":
        return None
    if not (ipaddress.ip_address(remote[0]).is_loopback or remote[0] == local[0]):
        return None  # from another host: its sockets are not in this host's tables
    # The other end's entry: its local address is our remote one, and the other way round.
    want = (ip_bytes(remote[0]), remote[1], ip_bytes(local[0]), local[1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) < 10 or cols[9] == "0":  # no inode: nobody holds it
                        continue
                    here, there = _proc_endpoint(cols[1]), _proc_endpoint(cols[2])
                    if here is None or there is None:
                        continue
                    if (here[0], here[1], there[0], there[1]) == want:
                        return int(cols[7])
        except (OSError, ValueError):
            continue
    return None


def _proc_endpoint(text: str) -> tuple[bytes, int] | None:
    """An address of /proc/net/tcp ("0100007F:1F90": the IP as 32-bit words in host order, which
    `peer_uid` reads on little-endian hosts only)."""
    ip_hex, _, port_hex = text.partition(":")
    try:
        words = bytes.fromhex(ip_hex)
        port = int(port_hex, 16)
    except ValueError:
        return None
    if len(words) not in (4, 16):
        return None
    raw = b"".join(words[i : i + 4][::-1] for i in range(0, len(words), 4))
    if len(raw) == 4:
        raw = b"\0" * 10 + b"\xff\xff" + raw
    return raw, port
