"""``swap_group.release``: the groups are let go while the interpreter still runs (a
gloo group freed in its teardown can abort the process), and the world can be made
again after it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tmd.runtime import swap_group


def test_release_lets_go_of_every_group_and_a_world_can_be_installed_again() -> None:
    world = swap_group.install(rank=0, size=1)
    try:
        inner = swap_group.Loopback(0, 1)
        world.swap(inner)
        ones = torch.ones(2)
        dist.all_reduce(ones)  # through the world to its inner group
        assert swap_group.groups() == [world] and ones.tolist() == [1.0, 1.0]
    finally:
        swap_group.release()
    assert not swap_group.installed() and not dist.is_initialized()
    assert swap_group.groups() == [] and world.inner is None
    again = swap_group.install(rank=0, size=1)  # nothing of the old world is left
    swap_group.release()
    assert again is not world and not swap_group.installed()


def test_what_still_holds_groups_lets_go_first_and_once() -> None:
    """A session alive at exit (opened at a script's top level) drops its groups when
    ``release`` runs, before the world goes."""
    seen: list[bool] = []
    swap_group.install(rank=0, size=1)
    swap_group.on_release(lambda: seen.append(swap_group.installed()))
    swap_group.release()
    swap_group.release()
    assert seen == [True]
