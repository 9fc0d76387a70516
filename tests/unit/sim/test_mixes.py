"""Failure mixes: the packaged data says what its sources say, a bad file is refused
naming its key, and the sampler is seeded, stream-separated and Poisson at the
published rate."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from tmd.detectors.gpu_health import GpuHealthConfig
from tmd.sim import mixes
from tmd.sim.mixes import Failure, load, load_failslow, sample

LLAMA3_GPUS = 16_384
LLAMA3_DAYS = 54.0
LLAMA3_UNEXPECTED = 419


def unexpected(failures: list[Failure]) -> list[Failure]:
    return [f for f in failures if f.signal not in ("planned", "straggler")]


# -- packaged data -------------------------------------------------------------------


def test_llama3_table5_counts_sum_to_419_and_weights_to_one() -> None:
    mix = load("llama3")
    assert len(mix.causes) == 18
    assert sum(c.count for c in mix.causes) == LLAMA3_UNEXPECTED
    assert math.isclose(math.fsum(c.weight for c in mix.causes), 1.0)
    faulty = next(c for c in mix.causes if c.name == "faulty_gpu")
    assert faulty.count == 148
    assert math.isclose(faulty.weight, 148 / 419)  # 35.3%, not the printed 30.1%
    assert "30.1%" in mix.notes and "35.3%" in mix.notes


def test_llama3_rate_reproduces_the_published_interruptions() -> None:
    mix = load("llama3")
    nodes = LLAMA3_GPUS // mix.gpus_per_node
    assert math.isclose(mix.failures_per_node_day * nodes * LLAMA3_DAYS, LLAMA3_UNEXPECTED)
    assert math.isclose(mix.planned_per_day * LLAMA3_DAYS, 47)


@pytest.mark.parametrize("name", mixes.MIXES)
def test_every_cause_has_a_signal_and_a_source(name: str) -> None:
    mix = load(name)
    assert mix.source and mix.notes and mix.gpus_per_node == 8
    for cause in mix.causes:
        assert cause.signal in mixes.SIGNALS - {"planned", "straggler"}
        assert cause.source.strip()
        assert (cause.xid is not None) == (cause.signal == "xid")


def test_xid_causes_use_xids_the_gpu_health_detector_treats_as_fatal() -> None:
    # Otherwise the replayed fault would pass the real detector unseen.
    fatal = set(GpuHealthConfig().fatal_xids)
    xids = {c.name: c.xid for c in load("llama3").causes if c.signal == "xid"}
    assert xids and all(x in fatal for x in xids.values()), xids


def test_rsc_mixes_borrow_the_llama3_causes_at_their_own_rate() -> None:
    llama3, rsc1, rsc2 = load("llama3"), load("rsc1"), load("rsc2")
    assert rsc1.causes == llama3.causes == rsc2.causes
    assert (rsc1.failures_per_node_day, rsc2.failures_per_node_day) == (6.50e-3, 2.34e-3)
    # The paper's projection: 16,384 GPUs on RSC-1 fail every 1.8 h.
    assert round(24 / (2048 * rsc1.failures_per_node_day), 2) == 1.80
    assert "Llama 3" in rsc1.notes and "7.9 h" in rsc1.notes


def test_failslow_rate_gives_falcons_prevalence_on_a_512_gpu_day() -> None:
    fs = load_failslow()
    hit = 1 - math.exp(-64 * fs.episodes_per_node_day * 1.0)
    assert math.isclose(hit, 16 / 27, rel_tol=1e-9)
    mean_s = math.exp(fs.duration_log_mean_s + fs.duration_log_sigma**2 / 2)
    assert math.isclose(mean_s / 60, 72, rel_tol=1e-3)  # before the 10 h cap
    mean_slowdown = math.exp(fs.slowdown_log_mean + fs.slowdown_log_sigma**2 / 2)
    assert math.isclose(mean_slowdown, 0.3459, rel_tol=1e-3)
    assert {c.signal for c in fs.causes} == {"straggler"}


def test_unknown_name_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown name 'llama4'"):
        load("llama4")


# -- bad files -----------------------------------------------------------------------

GOOD = """
name = "tiny"
source = "test"
gpus_per_node = 8
failures_per_node_day = 0.01
planned_per_day = 1.0
notes = "n"

[[causes]]
name = "faulty_gpu"
count = 3
signal = "xid"
xid = 79
source = "s"

[[causes]]
name = "software_bug"
count = 1
signal = "crash"
source = "s"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mix.toml"
    path.write_text(text)
    return path


def test_a_file_by_path_loads_and_weights_are_shares(tmp_path: Path) -> None:
    mix = load(write(tmp_path, GOOD))
    assert [c.weight for c in mix.causes] == [0.75, 0.25]


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        ("gpus_per_node = 8\n", "", "gpus_per_node"),  # missing
        ("failures_per_node_day = 0.01", 'failures_per_node_day = "0.01"', "failures_per_node_day"),
        ("gpus_per_node = 8", "gpus_per_node = 8.0", "gpus_per_node"),  # wrong type
        ("planned_per_day = 1.0", "planned_per_day = -1.0", "planned_per_day"),
        ('signal = "crash"', 'signal = "meteor"', r"causes\[1\]\.signal"),  # unknown signal
        ('source = "s"\n\n[[causes]]', "\n[[causes]]", r"causes\[0\]\.source"),
        ("xid = 79\n", "", r"causes\[0\]\.xid"),  # an xid cause without its XID
        ("count = 1", "count = true", r"causes\[1\]\.count"),
        ('signal = "crash"', 'signal = "planned"', r"causes\[1\]\.signal"),
        ("notes =", "nots =", "nots"),  # a typo is an unknown key, not silently ignored
        ('notes = "n"', 'notes = "n"\ncauses_from = "llama3"', "causes"),  # both
    ],
)
def test_a_bad_file_raises_naming_the_key(tmp_path: Path, old: str, new: str, key: str) -> None:
    assert old in GOOD
    with pytest.raises(ValueError, match=rf"mix\.toml: {key}: "):
        load(write(tmp_path, GOOD.replace(old, new, 1)))


def test_a_file_may_borrow_a_packaged_cause_mix(tmp_path: Path) -> None:
    head = GOOD.split("[[causes]]")[0]
    mix = load(write(tmp_path, head + 'causes_from = "llama3"\n'))
    assert mix.causes == load("llama3").causes and mix.failures_per_node_day == 0.01


def test_invalid_toml_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not valid TOML"):
        load(write(tmp_path, "name = "))


# -- sampling ------------------------------------------------------------------------


def test_same_seed_same_sample_other_seed_other_sample() -> None:
    mix, fs = load("llama3"), load_failslow()
    a = sample(mix, gpus=4096, days=10, seed=7, failslow=fs)
    assert a == sample(mix, gpus=4096, days=10, seed=7, failslow=fs)
    assert a != sample(mix, gpus=4096, days=10, seed=8, failslow=fs)
    assert [f.t_s for f in a] == sorted(f.t_s for f in a)


def test_failslow_and_planned_do_not_change_the_unexpected_failures() -> None:
    mix = load("llama3")
    plain = sample(mix, gpus=8192, days=20, seed=3, planned=False)
    assert plain == unexpected(plain)
    full = sample(mix, gpus=8192, days=20, seed=3, failslow=load_failslow())
    assert unexpected(full) == plain
    assert {f.signal for f in full} >= {"planned", "straggler", "xid", "node_lost", "crash"}


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_llama3_over_54_days_at_16k_gpus_is_poisson_around_419(seed: int) -> None:
    got = len(unexpected(sample(load("llama3"), gpus=LLAMA3_GPUS, days=LLAMA3_DAYS, seed=seed)))
    assert abs(got - LLAMA3_UNEXPECTED) <= 4 * math.sqrt(LLAMA3_UNEXPECTED)


def test_planned_interruptions_come_at_the_job_rate() -> None:
    mix = replace(load("llama3"), planned_per_day=100.0)
    planned = [f for f in sample(mix, gpus=8, days=10, seed=1) if f.signal == "planned"]
    assert abs(len(planned) - 1000) <= 4 * math.sqrt(1000)
    assert {f.cause for f in planned} == {mixes.PLANNED_CAUSE}


def test_failures_carry_what_their_signal_needs() -> None:
    fs = load_failslow()
    failures = sample(load("rsc1"), gpus=2048 * 8, days=5, seed=11, failslow=fs)
    machines = 2048
    for f in failures:
        assert 0 <= f.machine < machines and 0 <= f.t_s < 5 * 86_400
        assert (f.xid is not None) == (f.signal == "xid")
        if f.signal == "straggler":
            assert 0 < f.slowdown <= fs.slowdown_max and 0 < f.duration_s <= 5 * 86_400
        else:
            assert f.slowdown == f.duration_s == 0.0
    slow = [f for f in failures if f.cause == mixes.SLOW_MACHINE_CAUSE]
    # ~0.5% of 2,048 machines (MegaScale): 10 expected.
    assert 0 < len(slow) < 30 and all(f.t_s == 0.0 for f in slow)


def test_machines_round_up_to_whole_servers() -> None:
    mix = replace(load("llama3"), failures_per_node_day=50.0)
    hit = {f.machine for f in sample(mix, gpus=9, days=1, seed=0, planned=False)}
    assert hit == {0, 1}


def test_bad_arguments_are_refused() -> None:
    mix = load("llama3")
    with pytest.raises(ValueError, match="gpus"):
        sample(mix, gpus=0, days=1, seed=0)
    with pytest.raises(ValueError, match="days"):
        sample(mix, gpus=8, days=-1, seed=0)
    assert sample(mix, gpus=8, days=0, seed=0, failslow=load_failslow()) == []
