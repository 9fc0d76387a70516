"""No code runs from data: transfer payloads and checkpoints are decoded without
pickle's calls, and state that would not come back is refused where it is sent."""

from __future__ import annotations

import io
import pickle
import random
import warnings
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy
import pytest
import torch

from tmd.errors import MigrationError
from tmd.runtime.checkpoint_io import (
    load_bulk,
    load_checkpoint,
    read_small_state,
    write_checkpoint,
)
from tmd.runtime.data import ResumableSampler
from tmd.runtime.group import Group
from tmd.runtime.session import Session
from tmd.runtime.state import TrainState, pack, unpack
from tmd.runtime.transfer import Kind, TransferChannel

# torch notes, before refusing it, that a plain pickle is no torch.save archive.
pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")


class _Exploit:
    """Unpickling this creates ``target``: proof that the payload's code ran."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.target), "w"))


def _crafted(target: Path, *, how: str) -> bytes:
    payload = {"step": 1, "rng": _Exploit(target)}
    if how == "pickle":  # what the pickling runtime read
        return pickle.dumps(payload)
    buffer = io.BytesIO()
    torch.save(payload, buffer)  # the container of the safe encoding, carrying a call
    return buffer.getvalue()


def _train_state(seed: int, *, steps: int) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.95))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    sampler = ResumableSampler(40, batch_size=4, rank=0, world_size=2, seed=seed)
    state = TrainState(model, optimizer, scheduler, {"sampler": sampler})
    for _ in range(steps):
        sampler.next_batch()
        model(torch.randn(4, 6)).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        state.step += 1
    numpy.random.randn(), random.gauss(0, 1)  # both streams now hold a cached Gaussian
    return state


def _draws(state: TrainState) -> tuple[Any, ...]:
    sampler = cast(ResumableSampler, state.stateful["sampler"])
    return (
        torch.rand(4).tolist(),
        numpy.random.rand(3).tolist(),
        numpy.random.randn(),  # the cached Gaussian of numpy's state, too
        [random.random() for _ in range(3)],
        random.gauss(0, 1),
        sampler.next_batch(),
    )


# -- (a) the transfer channel --------------------------------------------------------


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_crafted_transfer_payload_is_refused_and_runs_nothing(tmp_path: Path, how: str) -> None:
    target = tmp_path / "pwned"
    body = torch.frombuffer(bytearray(_crafted(target, how=how)), dtype=torch.uint8)

    with pytest.raises(ValueError, match="transfer payload"):
        unpack(body)
    assert not target.exists()


class _Wire:
    """A group that hands the joiner prepared tensors, as a peer would send them."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._tensors = tensors

    def recv(self, into: list[torch.Tensor], peer: int, tag: int) -> Any:
        into[0].copy_(self._tensors.pop(0))
        return SimpleNamespace(wait=lambda: None)


def test_a_joiner_refuses_a_crafted_message_as_a_failed_migration(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    body = torch.frombuffer(bytearray(_crafted(target, how="pickle")), dtype=torch.uint8)
    header = torch.tensor([int(Kind.SWITCH), 3, body.numel()], dtype=torch.int64)
    joiner = TransferChannel(cast(Group, _Wire([header, body])), is_leaver=False)

    with pytest.raises(MigrationError, match="SWITCH from the leaver"):
        joiner.recv()
    assert not target.exists()


# -- (b) checkpoints -------------------------------------------------------------------


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_planted_small_state_file_is_refused_and_runs_nothing(tmp_path: Path, how: str) -> None:
    target = tmp_path / "pwned"
    planted = tmp_path / "small-rank0.pt"
    planted.write_bytes(_crafted(target, how=how))

    with pytest.raises(ValueError, match=r"small-rank0\.pt"):
        read_small_state(planted)
    assert not target.exists()


def _session(state: TrainState) -> Session:
    return cast(Session, SimpleNamespace(rank=0, state=state, wrapped=False))


def test_a_planted_bulk_table_of_contents_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    write_checkpoint(_session(_train_state(0, steps=1)), tmp_path)
    target = tmp_path / "pwned"
    (tmp_path / "bulk" / ".metadata").write_bytes(pickle.dumps(_Exploit(target)))

    with pytest.raises(ValueError, match=r"\.metadata: refused to load \(it refers to io\.open\)"):
        load_bulk(_train_state(1, steps=0), tmp_path / "bulk")
    assert not target.exists()


def test_a_planted_bulk_entry_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    """torch's own planner loads the entries that are no tensors (the optimizer's
    hyper-parameters) with ``weights_only=False``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    state = _train_state(0, steps=1)
    model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
    target = tmp_path / "pwned"
    optim_sd["param_groups"][0]["lr"] = _Exploit(target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp_path, no_dist=True)

    with pytest.raises(ValueError, match=r"optimizer\.param_groups\.0\.lr"):
        load_bulk(_train_state(1, steps=0), tmp_path)
    assert not target.exists()


def test_a_small_state_file_of_the_pickling_runtime_loads_if_plain_else_says_why(
    tmp_path: Path,
) -> None:
    old = tmp_path / "small-rank0.pt"
    small = _train_state(0, steps=2).small_state()
    torch.save({**small, "rng": {**small["rng"], "numpy": numpy.random.get_state()}}, old)

    with pytest.raises(ValueError, match="An earlier tmd pickled numpy's RNG state"):
        read_small_state(old)

    del small["rng"]["numpy"]  # written where numpy was not installed: plain values only
    torch.save(small, old)
    assert read_small_state(old)["hyperparams"] == small["hyperparams"]


# -- (c) what goes out comes back exactly ------------------------------------------------


def _assert_same_replica(restored: TrainState, source: TrainState) -> None:
    assert restored.step == source.step
    assert restored.hyperparams() == source.hyperparams()
    assert restored.hyperparams()[0]["betas"] == (0.8, 0.95)  # a tuple, as AdamW wants
    assert restored.scheduler is not None and source.scheduler is not None
    assert restored.scheduler.state_dict() == source.scheduler.state_dict()


def test_the_small_state_round_trips_through_the_channel_encoding() -> None:
    source = _train_state(0, steps=3)
    small = source.small_state()
    expected = _draws(source)

    torch.manual_seed(99), numpy.random.seed(99), random.seed(99)
    target = _train_state(1, steps=0)
    manifest = unpack(pack(source.manifest()))
    for dst, src in zip(target.receive_tensors(manifest), source.bulk_tensors(), strict=True):
        dst.copy_(src)
    target.load_small_state(unpack(pack(small)))

    _assert_same_replica(target, source)
    assert _draws(target) == expected
    target.load_hyperparams(unpack(pack(source.hyperparams())))  # every GRADS message
    assert target.hyperparams() == source.hyperparams()


def test_a_checkpoint_restores_the_same_state_and_streams(tmp_path: Path) -> None:
    source = _train_state(0, steps=3)
    write_checkpoint(_session(source), tmp_path)
    expected = _draws(source)

    torch.manual_seed(99), numpy.random.seed(99), random.seed(99)
    target = _train_state(1, steps=0)
    load_checkpoint(_session(target), tmp_path)

    _assert_same_replica(target, source)
    for name, tensor in source.model.state_dict().items():
        assert torch.equal(target.model.state_dict()[name], tensor)
    for p_src, p_dst in zip(source.params(), target.params(), strict=True):
        for key, value in source.optimizer.state[p_src].items():
            assert torch.equal(target.optimizer.state[p_dst][key], value)
    assert _draws(target) == expected


# -- (d) state that would not come back is refused at the sender -------------------------


class _Sampler:
    def __init__(self, foo: object) -> None:
        self.foo = foo

    def state_dict(self) -> dict[str, Any]:
        return {"position": 3, "foo": self.foo}

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        self.foo = state_dict["foo"]


Point = namedtuple("Point", "x y")


@pytest.mark.parametrize(
    ("foo", "kind"),
    [
        (numpy.float64(0.5), "numpy.float64"),  # a float subclass: pickles as numpy's
        (Point(1, 2), "Point"),
        ([1, {"deep": object()}], "builtins.object"),
    ],
)
def test_unsafe_user_state_is_refused_where_it_is_sent_naming_its_key(
    tmp_path: Path, foo: object, kind: str
) -> None:
    state = _train_state(0, steps=1)
    state.stateful["sampler"] = _Sampler(foo)
    where = "stateful.sampler.foo.1.deep" if isinstance(foo, list) else "stateful.sampler.foo"
    message = rf"^{where}: type \S*{kind} cannot be sent or checkpointed safely"

    with pytest.raises(ValueError, match=message):
        pack(state.small_state())
    with pytest.raises(ValueError, match=message):
        write_checkpoint(_session(state), tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()  # refused before anything was written
    leaver = TransferChannel(cast(Group, None), is_leaver=True)
    with pytest.raises(MigrationError, match=f"cannot send SWITCH: {where}"):
        leaver.send(Kind.SWITCH, state.step, state.small_state())
