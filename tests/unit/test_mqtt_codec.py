"""MQTT 3.1.1 framing, topic filters and the subscription tree of the embedded broker,
table-tested against the spec."""

from __future__ import annotations

from typing import Any

import pytest

from tmd.errors import ProtocolError
from tmd.mqtt_codec import (
    SubscriptionTree,
    encode_length,
    matches,
    packet_bounds,
    parse_filter,
)


class _Unread:
    """A packet whose body has not been read yet: only its length is known."""

    def __init__(self, head: bytes, body_bytes: int) -> None:
        self.head, self.body_bytes = head, body_bytes

    def __len__(self) -> int:
        return len(self.head) + self.body_bytes

    def __getitem__(self, i: int) -> int:
        return self.head[i]


@pytest.mark.parametrize("n", [0, 1, 127, 128, 16_383, 16_384, 2_097_151, 2_097_152, 268_435_455])
def test_remaining_length_round_trips_up_to_256_mb(n: int) -> None:
    head = b"\x30" + encode_length(n)
    assert len(head) == 2 + (n > 127) + (n > 16_383) + (n > 2_097_151)
    if n:
        assert packet_bounds(_Unread(head, n - 1), 0, 1 << 30) is None  # not all there yet
    assert packet_bounds(_Unread(head, n), 0, 1 << 30) == (0x30, len(head), len(head) + n)


def test_framing_rejects_long_lengths_and_big_packets() -> None:
    with pytest.raises(ProtocolError, match="four bytes"):
        packet_bounds(b"\x30\xff\xff\xff\xff\x01", 0, 1 << 30)
    with pytest.raises(ProtocolError) as exc:
        packet_bounds(b"\x30" + encode_length(1001), 0, 1000)
    assert exc.value.reason == "oversize"
    assert packet_bounds(b"\xc0\x00\xd0", 0, 10) == (0xC0, 2, 2)
    assert packet_bounds(b"\xc0\x00\xd0", 2, 10) is None  # a packet cut after one byte


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("a/b", (None, ("a", "b"))),
        ("a/+/#", (None, ("a", "+", "#"))),
        ("#", (None, ("#",))),
        ("/", (None, ("", ""))),
        ("$share/g/a/+", ("g", ("a", "+"))),
        ("", None),
        ("a/#/b", None),
        ("a#", None),
        ("a/b+", None),
        ("$share/g", None),
        ("$share//a", None),
        ("$share/g+/a", None),
        ("a\0b", None),
    ],
)
def test_topic_filters_are_validated(text: str, parsed: Any) -> None:
    assert parse_filter(text) == parsed


TOPICS = ["w/a/c", "w/b/c", "w/a/d", "w/a/c/d", "w", "w/", "x/x", "$SYS/x", "$SYS/a/x"]
EXPECTED = {
    "w/+/c": {"w/a/c", "w/b/c"},
    "w/#": {"w/a/c", "w/b/c", "w/a/d", "w/a/c/d", "w", "w/"},
    "w/a/c/#": {"w/a/c", "w/a/c/d"},
    "w/+": {"w/"},
    "+/x": {"x/x"},
    "+/+/x": set(),
    "#": {"w/a/c", "w/b/c", "w/a/d", "w/a/c/d", "w", "w/", "x/x"},
    "$SYS/#": {"$SYS/x", "$SYS/a/x"},
    "$SYS/+/x": {"$SYS/a/x"},
}


@pytest.mark.parametrize(("text", "expected"), EXPECTED.items())
def test_tree_and_retained_matching_agree_with_the_spec(text: str, expected: set[str]) -> None:
    tree: SubscriptionTree[str] = SubscriptionTree()
    _, levels = parse_filter(text) or (None, ())
    tree.add("s", None, levels, 1)
    assert {t for t in TOPICS if tree.match(t)} == expected
    assert {t for t in TOPICS if matches(levels, t)} == expected
    tree.remove("s", None, levels)
    assert tree.match("w/a/c") == {} and not tree._root.children  # pruned


def test_tree_gives_the_highest_qos_and_takes_turns_in_a_share_group() -> None:
    tree: SubscriptionTree[str] = SubscriptionTree()
    tree.add("a", None, ("t", "#"), 0)
    tree.add("a", None, ("t", "+"), 1)
    tree.add("m1", "g", ("t", "+"), 1)
    tree.add("m2", "g", ("t", "+"), 0)
    got = [tree.match("t/x") for _ in range(4)]
    assert [g["a"] for g in got] == [1, 1, 1, 1]
    assert [sorted(set(g) - {"a"}) for g in got] == [["m1"], ["m2"], ["m1"], ["m2"]]
    tree.remove("m1", "g", ("t", "+"))
    assert tree.match("t/x") == {"a": 1, "m2": 0}
