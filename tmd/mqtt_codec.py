"""MQTT 3.1.1 as data: framing, packet fields, topic names and filters, and the tree
that matches a topic to the filters subscribed to it. Pure: no I/O, no asyncio; every
malformed input is a ``ProtocolError``, so the embedded broker
(``tmd.tools.embedded_broker``) can drop the one client that sent it. The daemon's
QoS 0 read path (``tmd.connection.handle_qos0_inline``) and the load generator
(``tmd.tools.synth``) frame packets with it too.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Final, Generic, TypeVar

from tmd.errors import ProtocolError

MAX_REMAINING_LENGTH: Final = 268_435_455  # four varint bytes: 256 MB


def packet_bounds(
    data: bytes | bytearray | memoryview, pos: int, max_bytes: int
) -> tuple[int, int, int] | None:
    """``(first byte, body start, body end)`` of the packet at ``pos`` in ``data``, or
    None while it is incomplete. ProtocolError when its remaining length is longer than
    four bytes or over ``max_bytes``."""
    n = len(data)
    i = pos + 1
    length = 0
    shift = 0
    while True:
        if i >= n:
            return None
        byte = data[i]
        i += 1
        length |= (byte & 0x7F) << shift
        if byte < 0x80:
            break
        shift += 7
        if shift > 21:
            raise ProtocolError("packet", "remaining length longer than four bytes")
    if length > max_bytes:
        raise ProtocolError("oversize", f"packet of {length} bytes > {max_bytes}")
    end = i + length
    return (data[pos], i, end) if end <= n else None


def encode_length(n: int) -> bytes:
    if not 0 <= n <= MAX_REMAINING_LENGTH:
        raise ValueError(f"remaining length {n} out of range")
    out = bytearray()
    while True:
        n, byte = divmod(n, 128)
        out.append(byte | 0x80 if n else byte)
        if not n:
            return bytes(out)


def valid_topic(topic: str) -> bool:
    """A topic name one may publish to: not empty, no wildcards, no NUL."""
    return bool(topic) and not any(c in topic for c in "+#\0")


def parse_filter(text: str) -> tuple[str | None, tuple[str, ...]] | None:
    """``(share group or None, levels)`` of a valid topic filter, None when invalid."""
    group = None
    if text.startswith("$share/"):
        group, _, text = text[len("$share/") :].partition("/")
        if not group or any(c in group for c in "+#") or not text:
            return None
    if not text or "\0" in text:
        return None
    levels = tuple(text.split("/"))
    for i, level in enumerate(levels):
        if ("#" in level and (level != "#" or i != len(levels) - 1)) or (
            "+" in level and level != "+"
        ):
            return None
    return group, levels


def matches(levels: tuple[str, ...], topic: str) -> bool:
    """Whether the filter ``levels`` matches ``topic`` (leading wildcards skip ``$``)."""
    if topic.startswith("$") and levels[0] in ("+", "#"):
        return False
    parts = topic.split("/")
    for i, level in enumerate(levels):
        if level == "#":
            return True
        if i >= len(parts) or (level != "+" and level != parts[i]):
            return False
    return len(parts) == len(levels)


S = TypeVar("S", bound=Hashable)


class _Group(Generic[S]):
    __slots__ = ("members", "turn")

    def __init__(self) -> None:
        self.members: dict[S, int] = {}
        self.turn = 0


class _Node(Generic[S]):
    __slots__ = ("children", "groups", "subscribers")

    def __init__(self) -> None:
        self.children: dict[str, _Node[S]] = {}
        self.subscribers: dict[S, int] = {}
        self.groups: dict[str, _Group[S]] = {}


class SubscriptionTree(Generic[S]):
    """Subscribers (with their QoS) by filter level, so a topic is matched in time of
    its depth and the filters that fit it, not of every subscription."""

    def __init__(self) -> None:
        self._root: _Node[S] = _Node()

    def add(self, who: S, group: str | None, levels: tuple[str, ...], qos: int) -> None:
        node = self._root
        for level in levels:
            child = node.children.get(level)
            if child is None:
                child = node.children[level] = _Node()
            node = child
        if group is None:
            node.subscribers[who] = qos
        else:
            node.groups.setdefault(group, _Group()).members[who] = qos

    def remove(self, who: S, group: str | None, levels: tuple[str, ...]) -> None:
        path = [self._root]
        for level in levels:
            child = path[-1].children.get(level)
            if child is None:
                return
            path.append(child)
        node = path[-1]
        if group is None:
            node.subscribers.pop(who, None)
        elif (g := node.groups.get(group)) is not None:
            g.members.pop(who, None)
            if not g.members:
                del node.groups[group]
        for i in range(len(levels), 0, -1):  # prune what no longer leads anywhere
            n = path[i]
            if n.children or n.subscribers or n.groups:
                break
            del path[i - 1].children[levels[i - 1]]

    def match(self, topic: str) -> dict[S, int]:
        """Who gets a message on ``topic``, at the highest QoS any of its filters
        granted; one member of each matching share group, taking turns."""
        out: dict[S, int] = {}
        self._visit(self._root, topic.split("/"), 0, topic.startswith("$"), out)
        return out

    def _visit(
        self, node: _Node[S], levels: list[str], i: int, dollar: bool, out: dict[S, int]
    ) -> None:
        children = node.children
        if i == len(levels):
            _take(node, out)
            if (every := children.get("#")) is not None:  # "a/#" matches "a"
                _take(every, out)
            return
        if i or not dollar:
            if (every := children.get("#")) is not None:
                _take(every, out)
            if (one := children.get("+")) is not None:
                self._visit(one, levels, i + 1, dollar, out)
        if (exact := children.get(levels[i])) is not None:
            self._visit(exact, levels, i + 1, dollar, out)


def _take(node: _Node[S], out: dict[S, int]) -> None:
    for who, qos in node.subscribers.items():
        if qos > out.get(who, -1):
            out[who] = qos
    for group in node.groups.values():
        members = list(group.members.items())
        who, qos = members[group.turn % len(members)]
        group.turn += 1
        if qos > out.get(who, -1):
            out[who] = qos


class Fields:
    """Reads the fields of one packet body; running past its end is a ProtocolError."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise ProtocolError("packet", "field runs past the end of the packet")
        out = self.data[self.pos : end]
        self.pos = end
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int.from_bytes(self.take(2), "big")

    def binary(self) -> bytes:
        return self.take(self.u16())

    def text(self) -> str:
        return utf8(self.binary())

    def more(self) -> bool:
        return self.pos < len(self.data)

    def end(self) -> None:
        if self.more():
            raise ProtocolError("packet", "bytes after the last field")


def utf8(data: bytes) -> str:
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise ProtocolError("packet", "string is not UTF-8") from None


def publish_packet(field: bytes, payload: bytes, *, retain: bool, pid: int = 0) -> bytes:
    """A PUBLISH; QoS 1 when ``pid`` is given. ``field``: the length-prefixed topic."""
    ident = pid.to_bytes(2, "big") if pid else b""
    first = (0x32 if pid else 0x30) | retain
    length = len(field) + len(ident) + len(payload)
    return b"".join((bytes((first,)), encode_length(length), field, ident, payload))


def topic_field(topic: bytes) -> bytes:
    return len(topic).to_bytes(2, "big") + topic


def packet_id(body: bytes) -> int:
    if len(body) != 2:
        raise ProtocolError("packet", "acknowledgement of the wrong length")
    return int.from_bytes(body, "big")
