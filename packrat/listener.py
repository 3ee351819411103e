"""Who listens on a loopback TCP port: the key goes only to a listener of the caller's own user.

While the controller is down, any local user may bind its port (8085 is above 1024) and
would receive the management key with the next CLI call. Linux lists every socket with
the uid that created it in /proc/net/tcp and /proc/net/tcp6 (readable by everyone), so a
client can tell who would answer before it connects. The TorchServe plugin does the same
(plugin/src/packrat/plugin/ListenerOwner.java). Standard library only.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

_LISTEN = "0A"  # the kernel's TCP_LISTEN in the st column
_ROOT = 0


def _address(hex_words: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The kernel prints an address as 32-bit words in host byte order."""
    raw = bytes.fromhex(hex_words)
    if sys.byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(raw)
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped or address


def listener_uids(host: str, port: int, proc_net: Path = Path("/proc/net")) -> list[int]:
    """The uids of the sockets listening where a connection to host:port lands: bound to
    that address (or its IPv4-mapped form) or to the wildcard address."""
    target = ipaddress.ip_address(socket.gethostbyname(host) if host == "localhost" else host.strip("[]"))
    uids = []
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc_net / table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue  # no IPv6
        for line in lines:
            f = line.split()
            if len(f) < 8 or f[3] != _LISTEN:
                continue
            hex_address, hex_port = f[1].split(":")
            if int(hex_port, 16) != port:
                continue
            local = _address(hex_address)
            if local.is_unspecified or local == target:
                uids.append(int(f[7]))
    return uids


def loopback(url: str) -> bool:
    """`url` names this machine's loopback interface (localhost, 127.0.0.0/8, ::1)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: not on this machine's loopback


def untrusted_listener(url: str) -> str | None:
    """None if the management key may be sent to `url`; else why not (for a loopback URL: a
    socket there belongs to another user, or /proc cannot say whose it is). Nothing listening
    is None: the call then fails to connect as it would anyway. Other hosts are not checked."""
    if not loopback(url):
        return None
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    try:
        uids = listener_uids(host, port)
    except OSError as exc:
        return f"cannot tell who listens at {host}:{port} ({exc})"
    own = os.geteuid()
    strangers = sorted({u for u in uids if u not in (own, _ROOT)})
    if strangers:
        return (f"the socket listening at {host}:{port} belongs to uid {strangers[0]}, not to you "
                f"(uid {own}): the management key is not sent to it")
    return None
