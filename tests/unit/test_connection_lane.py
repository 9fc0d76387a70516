"""The QoS 0 read path's framing (``tmd.connection._Lane``) on a real socket pair,
read as paho 2 reads (``PahoReads``): QoS 0 PUBLISHes go to the handler whole however
the bytes arrive, every other packet goes to paho, the two in the order they came; a
frame paho refuses is paho's with all after it; the end of the stream reaches paho;
every read tells paho's keep-alive. With paho itself: tests/integration/test_mqtt_lane.py."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from tmd.connection import _Lane
from tmd.mqtt_codec import publish_packet, topic_field

PINGRESP = b"\xd0\x00"
SUBACK = b"\x90\x03\x00\x01\x00"

Timeline = list[tuple[str, object]]


def publish(topic: str, payload: bytes, *, retain: bool = False, pid: int = 0) -> bytes:
    return publish_packet(topic_field(topic.encode()), payload, retain=retain, pid=pid)


class PahoReads:
    """What paho 2 asks of its socket: ``loop_read`` reads one packet (its first byte,
    each byte of its length, then its body, keeping a partial packet for the next
    call; five length bytes are refused), and aiomqtt's reader calls it again while
    ``pending()``. Each packet read lands on the timeline, as the lane's handler's do."""

    def __init__(self, lane: _Lane, timeline: Timeline) -> None:
        self.lane, self.timeline = lane, timeline
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.packet = bytearray()
        self.lengths = 0
        self.length = 0
        self.need = -1

    def readable(self) -> None:
        while not self.closed:
            self._loop_read()
            if not self.lane.pending():
                return

    def _recv(self, n: int) -> bytes:
        data = self.lane.recv(n)
        if not data:
            self.timeline.append(("paho", "eof"))
            self.closed = True
        return data

    def _loop_read(self) -> None:
        try:
            if not self.packet and not (first := self._recv(1)):
                return
            if not self.packet:
                self.packet += first
            while self.need < 0:
                if not (byte := self._recv(1)):
                    return
                self.packet += byte
                self.length |= (byte[0] & 0x7F) << (7 * self.lengths)
                self.lengths += 1
                if self.lengths > 4:
                    self.timeline.append(("paho", "refused"))
                    self.closed = True
                    return
                if byte[0] < 0x80:
                    self.need = self.length
            while self.need > 0:
                if not (data := self._recv(self.need)):
                    return
                self.packet += data
                self.need -= len(data)
        except BlockingIOError:
            return
        self.timeline.append(("paho", bytes(self.packet)))
        self._reset()


class Reads:
    def __init__(self) -> None:
        self.timeline: Timeline = []
        self.told = 0  # reads paho's keep-alive was told of


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.setblocking(False)
    yield a, b
    a.close()
    b.close()


def reading(sock: socket.socket) -> tuple[PahoReads, Reads]:
    reads = Reads()

    def told() -> None:
        reads.told += 1

    lane = _Lane(sock, lambda t, p, r: reads.timeline.append(("lane", (t, p, r))), told)
    return PahoReads(lane, reads.timeline), reads


def test_packets_arriving_a_byte_at_a_time_are_framed_whole_and_in_order(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    paho, reads = reading(a)
    big = bytes(range(256)) * 80  # a three-byte remaining length
    q1 = publish("t/q1", b"z", pid=7)  # QoS 1: paho's, it acknowledges it
    q2 = b"\x34" + q1[1:]  # QoS 2: paho's too
    dup = b"\x38" + publish("t/dup", b"d")[1:]  # DUP on QoS 0 changes nothing
    stream = publish("t/1", big) + PINGRESP + publish("t/2", b"y", retain=True) + q1 + q2 + dup
    for i in range(len(stream)):
        b.send(stream[i : i + 1])
        paho.readable()
    assert reads.timeline == [
        ("lane", ("t/1", big, False)),
        ("paho", PINGRESP),
        ("lane", ("t/2", b"y", True)),
        ("paho", q1),
        ("paho", q2),
        ("lane", ("t/dup", b"d", False)),
    ]
    assert reads.told == len(stream)  # each read told paho's keep-alive


def test_many_packets_in_one_read_and_one_for_paho_between_them_keep_their_order(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    paho, reads = reading(a)
    first = b"".join(publish(f"m/{i}", b"%d" % i) for i in range(50))
    b.sendall(first + SUBACK + publish("m/last", b""))
    paho.readable()
    assert reads.timeline == [
        *[("lane", (f"m/{i}", b"%d" % i, False)) for i in range(50)],
        ("paho", SUBACK),
        ("lane", ("m/last", b"", False)),
    ]


@pytest.mark.parametrize(
    ("malformed", "paho_reads"),
    [
        (b"\x30\xff\xff\xff\xff\x01", ["refused"]),  # a remaining length of five bytes
        (b"\x30\x04\x00\x09ab", ["malformed", "after"]),  # a topic past its packet
        (b"\x30\x01\x00", ["malformed", "after"]),  # too short to hold a topic length
        (b"\x30\x03\x00\x00x", ["malformed", "after"]),  # an empty topic
    ],
)
def test_a_frame_paho_refuses_is_paho_s_with_all_after_it(
    pair: tuple[socket.socket, socket.socket], malformed: bytes, paho_reads: list[str]
) -> None:
    """paho drops the connection on it (this reader reads on, to show who got what)."""
    a, b = pair
    paho, reads = reading(a)
    after = publish("after", b"2")
    b.sendall(publish("ok", b"1") + malformed + after)
    paho.readable()
    packets = {"malformed": malformed, "after": after, "refused": "refused"}
    assert reads.timeline == [
        ("lane", ("ok", b"1", False)),
        *[("paho", packets[name]) for name in paho_reads],
    ]


def test_the_end_of_the_stream_reaches_paho_after_what_came_before_it(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    paho, reads = reading(a)
    b.sendall(publish("x", b"1") + PINGRESP + publish("y", b"2") + publish("cut", b"3")[:4])
    b.close()
    paho.readable()
    assert reads.timeline == [
        ("lane", ("x", b"1", False)),
        ("paho", PINGRESP),
        ("lane", ("y", b"2", False)),
        ("paho", "eof"),
    ]
    assert paho.lane.fileno() == a.fileno()  # the rest is the socket's
    with pytest.raises(AttributeError):
        paho.lane.recv_into  # noqa: B018 (a read past the lane would lose its frame)
