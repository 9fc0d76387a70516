"""The NVML adapter against the fake NVML: every field of a sample, every getter's
NotSupported tolerance, each scripted fault showing in the sample, init failures that
say what is missing, and XID events. The fake itself is checked against pynvml."""

from __future__ import annotations

import pytest

from tests.fakes import nvml as fake_mod
from tests.fakes.nvml import FakeGpu, FakeNvml
from tmd import wire
from tmd.agent.nvml import Nvml, NvmlUnavailable

SAMPLE_FIELDS = [f for f in wire.GpuSample.__struct_fields__ if f != "index"]


def open_fake(fake: FakeNvml) -> Nvml:
    return Nvml.open(fake)


def test_the_fake_uses_pynvml_names_and_values() -> None:
    pynvml = pytest.importorskip("pynvml")
    fake = FakeNvml(1)
    for name, value in fake_mod._CONSTANTS.items():
        assert getattr(pynvml, name) == value, name
    for name in fake_mod._ERROR_CLASSES:
        assert issubclass(getattr(pynvml, name), pynvml.NVMLError), name
    calls = [n for n in dir(FakeNvml) if n.startswith("nvml")]
    assert len(calls) > 20
    for name in calls:
        assert callable(getattr(pynvml, name)), name
    # The error mapping works as pynvml's does.
    err = fake.NVMLError(fake.NVML_ERROR_NOT_SUPPORTED)
    assert isinstance(err, fake.NVMLError_NotSupported) and err.value == 3
    assert pynvml.NVMLError(3).__class__.__name__ == type(err).__name__


def test_a_healthy_sample_has_every_field() -> None:
    fake = FakeNvml(2)
    nvml = open_fake(fake)
    assert [g.index for g in nvml.gpus] == [0, 1]
    assert nvml.gpus[0].name.startswith("NVIDIA") and nvml.gpus[0].memory_mb == 81559
    assert nvml.driver_version == "570.86.15"
    sample = nvml.sample()
    assert sample.errors == {}
    g = sample.gpus[1]
    assert all(getattr(g, f) is not None for f in SAMPLE_FIELDS), g
    assert (g.index, g.temp_c, g.power_w, g.util_pct, g.mem_used_mb) == (1, 41.0, 118.5, 87.0, 4096)
    assert g.remap_failure is False and g.clock_event_reasons == 0
    # It survives the wire as the daemon decodes it.
    message = wire.NodeGpu(ts=1.0, node="n", gpus=sample.gpus)
    assert wire.decode(wire.encode(message), wire.NodeGpu) == message
    nvml.close()
    assert fake.initialized == 0


GETTERS = [
    ("nvmlDeviceGetTemperature", ["temp_c"]),
    ("nvmlDeviceGetPowerUsage", ["power_w"]),
    ("nvmlDeviceGetUtilizationRates", ["util_pct"]),
    ("nvmlDeviceGetMemoryInfo", ["mem_used_mb"]),
    ("nvmlDeviceGetTotalEccErrors", [f for f in SAMPLE_FIELDS if f.startswith("ecc_")]),
    ("nvmlDeviceGetRetiredPagesPendingStatus", ["retired_pages_pending"]),
    ("nvmlDeviceGetRemappedRows", ["remap_pending", "remap_failure"]),
    ("nvmlDeviceGetNvLinkErrorCounter", ["nvlink_replay", "nvlink_recovery", "nvlink_crc"]),
    ("nvmlDeviceGetPcieReplayCounter", ["pcie_replay"]),
    ("nvmlDeviceGetFieldValues", ["recovery_action"]),
    (fake_mod._RECOVERY, ["recovery_action"]),
]


@pytest.mark.parametrize(("fn", "fields"), GETTERS)
@pytest.mark.parametrize("code", ["NOT_SUPPORTED", "FUNCTION_NOT_FOUND"])
def test_each_getter_tolerates_not_supported(fn: str, fields: list[str], code: str) -> None:
    fake = FakeNvml(2)
    fake.gpus[0].errors[fn] = getattr(fake_mod, f"NVML_ERROR_{code}")
    sample = open_fake(fake).sample()
    assert sample.errors == {}  # an absent feature is not an error
    gpu0, gpu1 = sample.gpus
    for f in SAMPLE_FIELDS:
        assert (getattr(gpu0, f) is None) == (f in fields), f
        assert getattr(gpu1, f) is not None, f


def test_clock_event_reasons_fall_back_to_the_old_name() -> None:
    # Bindings from before the rename: only ...ThrottleReasons exists.
    fake = FakeNvml(1, absent={"nvmlDeviceGetCurrentClocksEventReasons"})
    fake.thermal_throttle(0)
    assert open_fake(fake).sample().gpus[0].clock_event_reasons == fake_mod.THERMAL
    # Neither: None, not a crash.
    fake = FakeNvml(1)
    for fn in (
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
    ):
        fake.gpus[0].errors[fn] = fake_mod.NVML_ERROR_NOT_SUPPORTED
    assert open_fake(fake).sample().gpus[0].clock_event_reasons is None


def test_recovery_action_needs_the_field_in_the_bindings() -> None:
    fake = FakeNvml(1, absent={"NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"})
    fake.gpus[0].recovery_action = 2
    assert open_fake(fake).sample().gpus[0].recovery_action is None
    fake = FakeNvml(1)
    fake.gpus[0].recovery_action = fake_mod.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT
    assert open_fake(fake).sample().gpus[0].recovery_action == 2


def test_scripted_faults_show_in_the_sample() -> None:
    fake = FakeNvml(4)
    nvml = open_fake(fake)
    before = nvml.sample().gpus
    fake.double_bit_ecc(0)
    fake.row_remap_failure(1)
    fake.thermal_throttle(2, temp_c=95)
    fake.nvlink_replay_burst(3, count=700, link=2)
    fake.nvlink_replay_burst(3, count=300, link=17)
    after = nvml.sample().gpus
    assert (after[0].ecc_dbe_volatile, after[0].ecc_dbe_aggregate) == (1, 1)
    assert before[0].ecc_dbe_volatile == 0 and after[0].ecc_sbe_volatile == 0
    assert after[1].remap_failure is True and before[1].remap_failure is False
    assert after[2].clock_event_reasons == fake_mod.THERMAL and after[2].temp_c == 95.0
    assert after[3].nvlink_replay == 1000 and after[3].nvlink_crc == 0  # summed over links
    # Sustained: throttling is still there a sample later, and gone after cooling.
    assert nvml.sample().gpus[2].clock_event_reasons == fake_mod.THERMAL
    fake.cool_down(2)
    assert nvml.sample().gpus[2].clock_event_reasons == 0


def test_other_errors_are_recorded_and_the_rest_of_the_sample_stands() -> None:
    fake = FakeNvml(2)
    fake.gpus[1].errors["nvmlDeviceGetPcieReplayCounter"] = fake_mod.NVML_ERROR_UNKNOWN
    sample = open_fake(fake).sample()
    assert sample.gpus[1].pcie_replay is None and sample.gpus[1].temp_c == 41.0
    assert list(sample.errors) == [(1, "pcie_replay")]
    assert "nvmlDeviceGetPcieReplayCounter" in sample.errors[(1, "pcie_replay")]


def test_a_gpu_that_fell_off_the_bus() -> None:
    fake = FakeNvml(2)
    nvml = open_fake(fake)
    events = nvml.xid_events()
    assert events is not None and events.gpus == [0, 1]
    fake.fall_off_bus(1)
    xid = events.wait(1000)
    assert xid is not None and (xid.gpu, xid.xid) == (1, 79)
    sample = nvml.sample()
    assert all(getattr(sample.gpus[1], f) is None for f in SAMPLE_FIELDS)
    assert sample.gpus[0].temp_c == 41.0
    assert "GpuIsLost" in sample.errors[(1, "temp_c")]
    events.close()


def test_nvlink_links_are_probed_once() -> None:
    fake = FakeNvml([FakeGpu(nvlinks=0), FakeGpu(nvlinks=4)])
    nvml = open_fake(fake)
    fake.nvlink_replay_burst(1, count=5, link=3)
    for _ in range(3):
        sample = nvml.sample()
    assert sample.gpus[0].nvlink_replay is None  # a PCIe card
    assert sample.gpus[1].nvlink_replay == 5
    # One probe of all 36 links per GPU, then 3 counters x 4 links on GPU 1 per sample.
    probes = 2 * fake_mod.NVML_NVLINK_MAX_LINKS
    assert fake.calls["nvmlDeviceGetNvLinkErrorCounter"] == probes + 3 * 3 * 4


def test_xid_wait_times_out_and_skips_gpus_without_events() -> None:
    fake = FakeNvml(2)
    fake.gpus[0].errors["nvmlDeviceRegisterEvents"] = fake_mod.NVML_ERROR_NOT_SUPPORTED
    nvml = open_fake(fake)
    events = nvml.xid_events()
    assert events is not None and events.gpus == [1]
    assert events.wait(20) is None
    fake.xid(0, 13)  # not registered: never delivered
    fake.xid(1, 48)
    xid = events.wait(1000)
    assert xid is not None and (xid.gpu, xid.xid) == (1, 48) and xid.ts > 0
    assert events.wait(20) is None
    events.close()
    fake.gpus[1].errors["nvmlDeviceRegisterEvents"] = fake_mod.NVML_ERROR_NOT_SUPPORTED
    assert nvml.xid_events() is None


@pytest.mark.parametrize(
    ("fake", "says"),
    [
        (FakeNvml(init_error=fake_mod.NVML_ERROR_DRIVER_NOT_LOADED), "driver is not loaded"),
        (FakeNvml(init_error=fake_mod.NVML_ERROR_LIBRARY_NOT_FOUND), "libnvidia-ml.so.1"),
        (FakeNvml(init_error=fake_mod.NVML_ERROR_NO_PERMISSION), "/dev/nvidia"),
        (FakeNvml(0), "no GPU"),
    ],
)
def test_init_failures_say_what_is_missing(fake: FakeNvml, says: str) -> None:
    with pytest.raises(NvmlUnavailable, match=says):
        Nvml.open(fake)
    assert fake.initialized == 0  # shut down again when the inventory failed
