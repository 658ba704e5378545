"""Where the requests a config or a request body names may go: `allowed_hosts`.

An entry is a host (`tools.internal`, `127.0.0.1`, `::1`), a host and port
(`127.0.0.1:8767`, `[::1]:8000`) or a network in CIDR form (`10.0.0.0/8`, `fd00::/8`). A
URL passes when its host
- is a name an entry lists (and the port, where the entry gives one): the name is trusted
  for the addresses it resolves to, except the ones below;
- else when every address it is or resolves to is one an entry lists (with its port where
  the entry gives one) or lies in a listed network.

Link-local and cloud-metadata addresses (169.254.0.0/16, fe80::/10, fd00:ec2::254) pass
only where an entry names them explicitly: the address itself or a network inside those
ranges. A broad network (0.0.0.0/0, ::/0) or a name that resolves to one does not count, so
opening a policy wide never opens the metadata service with it.

The policy is checked twice: on the URL, when a job or a config is made
(`HostPolicy.url_refusal`), and again at connect time, on the addresses the name resolves
to then (`policed_client`): the connection goes to an address that was checked, so a name
that resolves elsewhere between the two (DNS rebinding) is refused. The clients made here
follow no redirects and read no proxy from the environment (the connection must go where it
was checked).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpcore
import httpx

from trainer.errors import AgentRFTError

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# Refused unless an entry names them: link-local (the cloud metadata services live there)
# and AWS's IPv6 metadata address.
SPECIAL = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"),
           ipaddress.ip_network("fd00:ec2::254/128"))
LOOPBACK = ("127.0.0.1", "::1", "localhost")


class OutboundRefused(AgentRFTError):
    """A request the host policy does not allow; retrying would not change that."""


@dataclass(frozen=True)
class _Entry:
    text: str
    name: str | None = None
    network: Network | None = None
    port: int | None = None

    @property
    def explicit_special(self) -> bool:
        """Whether the entry names link-local or metadata addresses on purpose: a network
        inside one of those ranges, not one that merely covers them."""
        return self.network is not None and any(
            self.network.version == s.version and self.network.subnet_of(s) for s in SPECIAL)  # type: ignore[arg-type]


def _address(text: str) -> Address | None:
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def parse_entry(text: str) -> _Entry:
    """One `allowed_hosts` entry; ValueError saying what is wrong with it."""
    raw = str(text).strip()
    if not raw:
        raise ValueError("an empty entry")
    if "/" in raw:
        try:
            return _Entry(raw, network=ipaddress.ip_network(raw, strict=False))
        except ValueError:
            raise ValueError(f"{raw!r} is not a network in CIDR form (e.g. 10.0.0.0/8)") from None
    host, port = raw, None
    if raw.startswith("["):
        host, _, rest = raw[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise ValueError(f"{raw!r}: write an IPv6 address and port as [::1]:8000")
        port = rest[1:] or None
    elif raw.count(":") == 1:
        host, port = raw.split(":")
    number = None
    if port is not None:
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{raw!r}: the port must be a number from 1 to 65535")
        number = int(port)
    address = _address(host)
    if address is not None:
        return _Entry(raw, network=ipaddress.ip_network(address), port=number)
    name = host.lower().rstrip(".")
    if not name or any(c in name for c in " /@?#[]") or ":" in name:
        raise ValueError(f"{raw!r} is not a host, host:port or CIDR network")
    return _Entry(raw, name=name, port=number)


def _url_host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(str(url))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise OutboundRefused(f"{url!r} is not an http(s) URL with a host")
    try:
        port = parts.port
    except ValueError:
        raise OutboundRefused(f"{url!r} has no valid port") from None
    return parts.hostname.lower().rstrip("."), port or (443 if parts.scheme == "https" else 80)


class HostPolicy:
    """The entries of an `allowed_hosts` list, checked on URLs and on connections."""

    def __init__(self, entries: Iterable[str]):
        self.entries = tuple(str(e) for e in entries)
        self._parsed = tuple(parse_entry(e) for e in self.entries)

    def __repr__(self) -> str:
        return f"HostPolicy({list(self.entries)})"

    def shown(self) -> str:
        return ", ".join(self.entries) or "(none)"

    def _name_listed(self, host: str, port: int) -> bool:
        return any(e.name == host and e.port in (None, port) for e in self._parsed)

    def address_refusal(self, address: Address, port: int) -> str | None:
        """Why a connection to `address:port` is refused, or None."""
        matching = [e for e in self._parsed if e.network is not None and e.port in (None, port)
                    and address in e.network]
        if any(address in s for s in SPECIAL):
            if not any(e.explicit_special for e in matching):
                return (f"{address} is a link-local or metadata address: allowed only where an entry names it "
                        "(the address, or a network inside 169.254.0.0/16 or fe80::/10)")
            return None
        return None if matching else f"{address} port {port} is not in allowed_hosts ({self.shown()})"

    def url_refusal(self, url: str, *, resolve: bool = True) -> str | None:
        """Why a request to `url` is refused, or None. A name that no entry lists is resolved
        and each of its addresses checked; with `resolve=False` (a config as it loads, no DNS
        lookup) it is refused. Connections are checked again when made."""
        try:
            host, port = _url_host_port(url)
        except OutboundRefused as exc:
            return str(exc)
        address = _address(host)
        if address is not None:
            return self.address_refusal(address, port)
        if self._name_listed(host, port):
            return None
        if not resolve:
            return (f"host {host!r} is not listed by name in allowed_hosts ({self.shown()}); a name is checked "
                    "here without a DNS lookup: list the name itself")
        try:
            addresses = resolve_host(host, port)
        except OSError as exc:
            return f"host {host!r} does not resolve ({exc}) and is not in allowed_hosts ({self.shown()})"
        for found in addresses:
            refusal = self.address_refusal(found, port)
            if refusal:
                return f"host {host!r} resolves to {refusal}"
        return None

    def connect_addresses(self, host: str, port: int, addresses: list[Address]) -> list[Address]:
        """The addresses `host` resolved to, each checked; OutboundRefused where any is refused
        (every one: a client may try them all)."""
        if not addresses:
            raise OutboundRefused(f"host {host!r} resolved to no address")
        listed = _address(host) is None and self._name_listed(host, port)
        for address in addresses:
            if listed and not any(address in s for s in SPECIAL):
                continue
            refusal = self.address_refusal(address, port)
            if refusal:
                shown = f"host {host!r} resolves to {refusal}" if _address(host) is None else refusal
                raise OutboundRefused(f"connection refused by allowed_hosts: {shown}")
        return addresses


def resolve_host(host: str, port: int) -> list[Address]:
    """The addresses `host` resolves to (the system's resolver, as a connection would)."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(a for a in (_address(info[4][0]) for info in found) if a is not None))


def policy_of(entries: Iterable[str] | None) -> HostPolicy | None:
    return None if entries is None else HostPolicy(entries)


def check_entries(entries: list[str] | None, where: str) -> list[str] | None:
    """`entries` unchanged, or ValueError naming the bad one (for config validators)."""
    for index, entry in enumerate(entries or []):
        try:
            parse_entry(entry)
        except ValueError as exc:
            raise ValueError(f"{where}[{index}]: {exc}") from None
    return entries


class _CheckedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, with each connection's host resolved and checked here,
    and the connection made to the checked address (TLS still verifies the name)."""

    def __init__(self, policies: list[HostPolicy], inner: httpcore.AsyncNetworkBackend):
        self.policies = policies
        self.inner = inner

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None, socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        import anyio

        name = host.lower().rstrip(".")
        literal = _address(name)
        if literal is not None:
            addresses = [literal]
        else:
            try:
                with anyio.fail_after(timeout):
                    found = await anyio.getaddrinfo(name, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                raise httpcore.ConnectError(f"host {host!r} does not resolve: {exc}") from None
            addresses = list(dict.fromkeys(a for a in (_address(str(info[4][0])) for info in found) if a is not None))
        for policy in self.policies:
            policy.connect_addresses(name, port, addresses)
        failure: Exception | None = None
        for address in addresses:
            try:
                return await self.inner.connect_tcp(str(address), port, timeout=timeout, local_address=local_address,
                                                    socket_options=socket_options)
            except httpcore.ConnectError as exc:
                failure = exc
        raise failure or httpcore.ConnectError(f"could not connect to {host}:{port}")

    async def connect_unix_socket(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        raise OutboundRefused("unix sockets are not reachable under allowed_hosts")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


def policed_client(policies: list[HostPolicy], **kwargs: Any) -> httpx.AsyncClient:
    """An httpx.AsyncClient that connects only where every one of `policies` allows (none: a
    plain client). It follows no redirects and reads no proxy from the environment."""
    if not policies:
        return httpx.AsyncClient(**kwargs)
    transport_args = {k: kwargs.pop(k) for k in ("verify", "limits") if k in kwargs}
    transport = httpx.AsyncHTTPTransport(**transport_args)
    pool = transport._pool
    if not isinstance(getattr(pool, "_network_backend", None), httpcore.AsyncNetworkBackend):
        # httpx or httpcore changed inside: the check cannot be put in place, so no client.
        raise OutboundRefused("allowed_hosts cannot be enforced with this httpx/httpcore version")
    pool._network_backend = _CheckedBackend(policies, pool._network_backend)
    return httpx.AsyncClient(transport=transport, follow_redirects=False, **kwargs)
