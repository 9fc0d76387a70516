"""Issue 12's fault-injection suite, one test per fault (``tmd bench faults``' own
stacks, at the smallest size: two machines of one rank and a standby machine, a real
mosquitto, ``tmd run`` in its own process). Each fault must be survived: every rank
exits 0, each final rank's parameters and every (rank, step) loss equal an undisturbed
reference run (one, shared), and every journaled migration ended exactly once.

The faults of the bench not run here are tested elsewhere, once: the paused broker in
``test_stale_view.py``, a joiner that dies while preparing in
``test_runtime_migration.py`` and a leaver that dies while its machine is joined in
``test_runtime_machines.py``. The bench's three relay faults (commands duplicated,
reordered, dropped) run here as one, ``ctl_mangled``, all three at once."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import _need_mosquitto, need_tool
from tmd.tools.bench import Progress
from tmd.tools.bench.faults import Reference, run_fault

PER_NODE = 1


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reference]:
    _need_mosquitto()
    yield Reference(tmp_path_factory.mktemp("reference"), per_node=PER_NODE)


def survive(name: str, root: Path, reference: Reference) -> dict[str, object]:
    result = run_fault(name, root / name, Progress(), reference=reference, per_node=PER_NODE)
    assert result["injected"], result
    assert result["params_equal"] and result["exactly_once"], result
    assert result["survived"], result
    return result


def test_forged_traffic_on_the_secure_broker_moves_nothing(
    tmp_path: Path, reference: Reference
) -> None:
    """The shipped broker configuration (TLS, passwords, ACL): an anonymous client is
    refused, clients of the wrong role publish forged commands, an ack, a job status,
    an XID and an offline status; nothing is accepted and the operator's migration
    still runs."""
    for tool in ("openssl", "mosquitto_passwd"):
        need_tool(tool, shutil.which(tool), install="apt-get install -y openssl mosquitto")
    r = survive("forged", tmp_path, reference)
    assert r["clients_refused"] == 1 and r["forged_sent"] > 0, r  # type: ignore[operator]
    assert r["forged_accepted"] == 0 and r["outcomes"] == ["done"], r


@pytest.mark.parametrize("phase", ["preparing", "switching"])
def test_a_broker_restart_during_a_migration_is_survived(
    tmp_path: Path, reference: Reference, phase: str
) -> None:
    r = survive(f"broker_restart_{phase}", tmp_path, reference)
    assert r["outcomes"] == ["done"], r


@pytest.mark.parametrize("phase", ["preparing", "switching"])
def test_a_daemon_killed_during_a_migration_finishes_it_exactly_once(
    tmp_path: Path, reference: Reference, phase: str
) -> None:
    """SIGKILLed in the journaled state (frozen the moment the journal shows it) and
    started again: the migration is resumed once from where it was, or found switched."""
    r = survive(f"daemon_kill_{phase}", tmp_path, reference)
    assert r["outcomes"] == ["done"] and len(r["resumed"]) <= 1, r  # type: ignore[arg-type]


def test_control_messages_mangled_by_a_relay_still_migrate_once(
    tmp_path: Path, reference: Reference
) -> None:
    """The daemon and the job on brokers of their own, joined by a test-only relay that
    loses the first copy of each command and delivers the others in swapped pairs,
    three times each: the three relay faults of ``tmd bench faults`` at once (each
    runs alone there)."""
    r = survive("ctl_mangled", tmp_path, reference)
    relayed = r["relayed"]
    assert isinstance(relayed, dict), r
    taken, given = relayed["down"], relayed["delivered"]
    # Every copy after the first is delivered three times: more than came down, short
    # of three times as many.
    assert 0 < taken < given < 3 * taken, r
    assert r["outcomes"] == ["done"], r
