"""The QoS 0 read path's framing (``tmd.connection._Lane``) on a real socket pair,
driven as paho drives it (``recv`` until it would block, then ``pending``): QoS 0
PUBLISHes go to the handler whole however the bytes arrive, every other packet goes
to paho byte for byte, the two in the order they came; a malformed frame is paho's;
the end of the stream reaches paho. With paho itself: tests/integration/test_mqtt_lane.py."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from tmd.connection import _Lane
from tmd.mqtt_codec import publish_packet, topic_field

PINGRESP = b"\xd0\x00"
SUBACK = b"\x90\x03\x00\x01\x00"


def publish(topic: str, payload: bytes, *, retain: bool = False, pid: int = 0) -> bytes:
    return publish_packet(topic_field(topic.encode()), payload, retain=retain, pid=pid)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.setblocking(False)
    yield a, b
    a.close()
    b.close()


def drive(lane: _Lane, timeline: list[tuple[str, object]]) -> None:
    """Read as paho does when the socket is readable: until it would block, and on
    while ``pending`` says there is more."""
    while True:
        while True:
            try:
                data = lane.recv(1)
            except BlockingIOError:
                break
            if not data:
                timeline.append(("paho", "eof"))
                return
            timeline.append(("paho", data))
        if not lane.pending():
            return


def merged(timeline: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """The timeline with the bytes paho read one by one joined per run."""
    out: list[tuple[str, object]] = []
    for who, what in timeline:
        if who == "paho" and isinstance(what, bytes) and out and out[-1][0] == "paho":
            last = out[-1][1]
            if isinstance(last, bytes):
                out[-1] = ("paho", last + what)
                continue
        out.append((who, what))
    return out


def lane_of(sock: socket.socket, timeline: list[tuple[str, object]]) -> _Lane:
    return _Lane(sock, lambda t, p, r: timeline.append(("lane", (t, p, r))))


def test_packets_arriving_a_byte_at_a_time_are_framed_whole_and_in_order(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    timeline: list[tuple[str, object]] = []
    lane = lane_of(a, timeline)
    big = bytes(range(256)) * 80  # a three-byte remaining length
    q1 = publish("t/q1", b"z", pid=7)  # QoS 1: paho's, it acknowledges it
    stream = publish("t/1", big) + PINGRESP + publish("t/2", b"y", retain=True) + q1
    for i in range(len(stream)):
        b.send(stream[i : i + 1])
        drive(lane, timeline)
    assert merged(timeline) == [
        ("lane", ("t/1", big, False)),
        ("paho", PINGRESP),
        ("lane", ("t/2", b"y", True)),
        ("paho", q1),
    ]


def test_many_packets_in_one_read_and_one_for_paho_between_them_keep_their_order(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    timeline: list[tuple[str, object]] = []
    lane = lane_of(a, timeline)
    b.sendall(
        b"".join([publish(f"m/{i}", b"%d" % i) for i in range(50)])
        + SUBACK
        + publish("m/last", b"")
    )
    drive(lane, timeline)
    assert merged(timeline) == [
        *[("lane", (f"m/{i}", b"%d" % i, False)) for i in range(50)],
        ("paho", SUBACK),
        ("lane", ("m/last", b"", False)),
    ]


@pytest.mark.parametrize(
    ("malformed", "framed"),
    [
        (b"\x30\xff\xff\xff\xff\x01", False),  # a remaining length of five bytes
        (b"\x30\x04\x00\x09ab", True),  # a topic longer than its packet
        (b"\x30\x01\x00", True),  # a PUBLISH too short to hold a topic length
    ],
)
def test_a_malformed_packet_is_paho_s_to_refuse(
    pair: tuple[socket.socket, socket.socket], malformed: bytes, framed: bool
) -> None:
    """paho drops the connection on it; the lane hands it over, and what it cannot
    frame with it."""
    a, b = pair
    timeline: list[tuple[str, object]] = []
    lane = lane_of(a, timeline)
    after = publish("after", b"2")
    b.sendall(publish("ok", b"1") + malformed + after)
    drive(lane, timeline)
    ok = ("lane", ("ok", b"1", False))
    if framed:
        assert merged(timeline) == [ok, ("paho", malformed), ("lane", ("after", b"2", False))]
    else:
        assert merged(timeline) == [ok, ("paho", malformed + after)]


def test_the_end_of_the_stream_reaches_paho_after_what_came_before_it(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    timeline: list[tuple[str, object]] = []
    lane = lane_of(a, timeline)
    b.sendall(publish("x", b"1") + PINGRESP + publish("y", b"2") + publish("cut", b"3")[:4])
    b.close()
    drive(lane, timeline)
    assert merged(timeline) == [
        ("lane", ("x", b"1", False)),
        ("paho", PINGRESP),
        ("lane", ("y", b"2", False)),
        ("paho", "eof"),
    ]
    assert lane.pending()  # aiomqtt reads on, and paho sees the end
    assert lane.fileno() == a.fileno()  # the rest is the socket's
