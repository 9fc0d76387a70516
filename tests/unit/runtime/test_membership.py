"""Membership: who holds which rank, and the next generation after a replacement."""

from __future__ import annotations

import dataclasses

import pytest

from tmd import wire
from tmd.errors import MigrationError
from tmd.runtime.membership import Membership


def test_replacing_a_machine_is_the_next_generation_with_everyone_else_in_place() -> None:
    before = Membership(4, ("n0", "n1", "n2"))

    after = before.replaced({"n1": "spare"})

    assert after == Membership(5, ("n0", "spare", "n2"))
    assert before == Membership(4, ("n0", "n1", "n2"))  # a record: the old one is intact
    assert after.members() == [
        wire.Member(0, "n0", 0), wire.Member(1, "spare", 0), wire.Member(2, "n2", 0)
    ]  # fmt: skip


def test_a_machine_of_two_ranks_moves_as_a_whole_by_local_rank() -> None:
    # Ranks 0 and 2 on m0, 1 and 3 on m1 (ranks need not be contiguous on a machine).
    before = Membership(0, ("m0", "m1", "m0", "m1"), (0, 0, 1, 1))

    assert before.ranks_of("m1") == (1, 3)
    assert before.machines() == {"m0": (0, 2), "m1": (1, 3)}
    after = before.replaced({"m1": "s0"})

    assert after.nodes == ("m0", "s0", "m0", "s0")
    assert [m.local_rank for m in after.members()] == [0, 0, 1, 1]
    assert after.ranks_of("s0") == (1, 3)


def test_a_slot_held_twice_is_refused() -> None:
    with pytest.raises(MigrationError, match="LOCAL_RANK"):
        Membership(0, ("m0", "m0"), (0, 0))


def test_ranks_of_a_non_member_names_the_generation() -> None:
    members = Membership(2, ("n0", "n1"))

    assert members.ranks_of("n1") == (1,)
    with pytest.raises(MigrationError, match="not a member of generation 2"):
        members.ranks_of("stranger")


def test_a_membership_cannot_be_changed_in_place() -> None:
    members = Membership(0, ("n0",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        members.generation = 1  # type: ignore[misc]
