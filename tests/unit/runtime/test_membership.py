"""Membership: who holds which rank, and the next generation after a replacement."""

from __future__ import annotations

import dataclasses

import pytest

from tmd import wire
from tmd.errors import MigrationError
from tmd.runtime.membership import Membership


def test_replacing_a_rank_is_the_next_generation_with_everyone_else_in_place() -> None:
    before = Membership(4, ("n0", "n1", "n2"))

    after = before.replaced(1, "spare")

    assert after == Membership(5, ("n0", "spare", "n2"))
    assert before == Membership(4, ("n0", "n1", "n2"))  # a record: the old one is intact
    assert after.members() == [wire.Member(0, "n0"), wire.Member(1, "spare"), wire.Member(2, "n2")]


def test_rank_of_a_non_member_names_the_generation() -> None:
    members = Membership(2, ("n0", "n1"))

    assert members.rank_of("n1") == 1
    with pytest.raises(MigrationError, match="not a member of generation 2"):
        members.rank_of("stranger")


def test_a_membership_cannot_be_changed_in_place() -> None:
    members = Membership(0, ("n0",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        members.generation = 1  # type: ignore[misc]
