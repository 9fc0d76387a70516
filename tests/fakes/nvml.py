"""A fake NVML: the pynvml calls ``tmd.agent.nvml`` makes, over scripted device state.

``FakeNvml`` carries pynvml's names (functions, ``NVML_*`` constants, the
``NVMLError_*`` classes) with pynvml's values and return shapes, so the adapter is
pointed at it in place of the module. tests/unit/agent/test_nvml.py checks every name
against the real bindings when they are installed.

Faults are scripted per GPU, now or ``after`` some seconds from nvmlInit: an XID, a
GPU falling off the bus (XID 79, then every call says GPU lost), a double-bit ECC
error, a row-remap failure, sustained thermal throttling, an NVLink replay burst, a
getter that hangs or is not supported.

``python -m tests.fakes.nvml --scenario NAME [tmd agent options]`` runs the real
agent over a named scenario, as a process tests can kill.
"""

from __future__ import annotations

import argparse
import string
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

# -- pynvml's constants (values checked against pynvml by the unit tests) --------------

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_UNKNOWN = 999
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_TEMPERATURE_GPU = 0
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_NVLINK_MAX_LINKS = 36
NVML_NVLINK_ERROR_DL_REPLAY = 0
NVML_NVLINK_ERROR_DL_RECOVERY = 1
NVML_NVLINK_ERROR_DL_CRC_FLIT = 2
NVML_VALUE_TYPE_DOUBLE = 0
NVML_VALUE_TYPE_UNSIGNED_INT = 1
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
NVML_GPU_RECOVERY_ACTION_NONE = 0
NVML_GPU_RECOVERY_ACTION_GPU_RESET = 1
NVML_GPU_RECOVERY_ACTION_NODE_REBOOT = 2
nvmlEventTypeXidCriticalError = 0x8
nvmlClocksEventReasonSwThermalSlowdown = 0x20
nvmlClocksEventReasonHwThermalSlowdown = 0x40
_RECOVERY = "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"
THERMAL = nvmlClocksEventReasonSwThermalSlowdown | nvmlClocksEventReasonHwThermalSlowdown


class NVMLError(Exception):
    """As pynvml: ``NVMLError(code)`` is an instance of the code's subclass."""

    _by_value: dict[int, type[NVMLError]] = {}
    _code = NVML_ERROR_UNKNOWN
    value: int

    def __new__(cls, value: int | None = None) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._by_value.get(value or NVML_ERROR_UNKNOWN, cls)
        obj = Exception.__new__(cls)
        obj.value = cls._code if value is None else value
        return obj

    def __init__(self, value: int | None = None) -> None:
        super().__init__(self.value)

    def __str__(self) -> str:
        return f"{type(self).__name__.removeprefix('NVMLError_')} ({self.value})"


# pynvml's rule: NVML_ERROR_NOT_SUPPORTED -> NVMLError_NotSupported.
_ERROR_CLASSES: dict[str, type[NVMLError]] = {}
for _name, _value in list(globals().items()):
    if _name.startswith("NVML_ERROR_"):
        _words = string.capwords(_name.removeprefix("NVML_ERROR_"), "_").replace("_", "")
        _cls = type(f"NVMLError_{_words}", (NVMLError,), {"__module__": __name__, "_code": _value})
        _ERROR_CLASSES[_cls.__name__] = NVMLError._by_value[_value] = _cls
globals().update(_ERROR_CLASSES)
_CONSTANTS = {
    k: v for k, v in globals().items() if k.startswith(("NVML_", "nvml")) and isinstance(v, int)
}


@dataclass
class FakeGpu:
    """One GPU's state; H100-like defaults, healthy."""

    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = ""
    memory_total_mb: int = 81559
    memory_used_mb: int = 4096
    temp_c: int = 41
    power_mw: int = 118_500
    util_pct: int = 87
    clock_reasons: int = 0
    ecc: dict[tuple[int, int], int] = field(default_factory=dict)  # (error type, counter)
    retired_pages_pending: bool = False
    remap: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # corr, unc, pend, fail
    nvlinks: int = 18
    nvlink_errors: Counter[tuple[int, int]] = field(default_factory=Counter)  # (link, counter)
    pcie_replay: int = 0
    recovery_action: int = NVML_GPU_RECOVERY_ACTION_NONE
    errors: dict[str, int] = field(default_factory=dict)  # pynvml function -> error code
    lost: bool = False
    hang_s: float = 0.0  # every device call sleeps this long first


@dataclass
class _EventSet:
    masks: dict[int, int] = field(default_factory=dict)
    queue: deque[_EventData] = field(default_factory=deque)


class FakeNvml:
    """Stands in for the pynvml module. Thread-safe, as NVML is."""

    absent: frozenset[str] = frozenset()  # names these "bindings" lack

    def __init__(
        self, gpus: int | list[FakeGpu] = 2, *, init_error: int | None = None, absent: Any = ()
    ) -> None:
        self.gpus = [FakeGpu() for _ in range(gpus)] if isinstance(gpus, int) else gpus
        for i, gpu in enumerate(self.gpus):
            gpu.uuid = gpu.uuid or f"GPU-fake-{i:04d}"
        self.init_error = init_error
        self.absent = frozenset(absent)
        self.initialized = 0
        self.calls: Counter[str] = Counter()
        self._lock = threading.Condition()
        self._sets: list[_EventSet] = []
        self._started = time.monotonic()
        self._due: list[tuple[float, Callable[[], None]]] = []

    def __getattribute__(self, name: str) -> Any:
        if name in object.__getattribute__(self, "absent"):
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    def __getattr__(self, name: str) -> Any:
        if name in self.absent:
            raise AttributeError(name)
        if name in _CONSTANTS:
            return _CONSTANTS[name]
        if name == "NVMLError":
            return NVMLError
        if name in _ERROR_CLASSES:
            return _ERROR_CLASSES[name]
        raise AttributeError(name)

    # -- scripting -----------------------------------------------------------------------

    def after(self, seconds: float, action: Callable[[], None]) -> None:
        """Run ``action`` once ``seconds`` have passed since nvmlInit."""
        with self._lock:
            self._due.append((seconds, action))

    def xid(self, gpu: int, code: int) -> None:
        with self._lock:
            event = _EventData(_Handle(gpu), nvmlEventTypeXidCriticalError, code)
            for s in self._sets:
                if s.masks.get(gpu, 0) & nvmlEventTypeXidCriticalError:
                    s.queue.append(event)
            self._lock.notify_all()

    def fall_off_bus(self, gpu: int) -> None:
        self.xid(gpu, 79)
        with self._lock:
            self.gpus[gpu].lost = True

    def double_bit_ecc(self, gpu: int, count: int = 1) -> None:
        with self._lock:
            ecc = self.gpus[gpu].ecc
            for counter in (NVML_VOLATILE_ECC, NVML_AGGREGATE_ECC):
                key = (NVML_MEMORY_ERROR_TYPE_UNCORRECTED, counter)
                ecc[key] = ecc.get(key, 0) + count

    def row_remap_failure(self, gpu: int) -> None:
        with self._lock:
            remap = self.gpus[gpu].remap
            remap[1] += 1
            remap[3] = 1

    def thermal_throttle(self, gpu: int, temp_c: int = 94) -> None:
        """Sustained: it stays until ``cool_down``."""
        with self._lock:
            self.gpus[gpu].clock_reasons |= THERMAL
            self.gpus[gpu].temp_c = temp_c

    def cool_down(self, gpu: int, temp_c: int = 41) -> None:
        with self._lock:
            self.gpus[gpu].clock_reasons &= ~THERMAL
            self.gpus[gpu].temp_c = temp_c

    def nvlink_replay_burst(self, gpu: int, count: int = 5000, link: int = 0) -> None:
        with self._lock:
            self.gpus[gpu].nvlink_errors[(link, NVML_NVLINK_ERROR_DL_REPLAY)] += count

    # -- pynvml: init and inventory ------------------------------------------------------

    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        with self._lock:
            self.initialized += 1
            self._started = time.monotonic()

    def nvmlShutdown(self) -> None:
        self._check()
        with self._lock:
            self.initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check()
        return "570.86.15"

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._check()
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetIndex(self, handle: _Handle) -> int:
        self._check()
        return handle.index

    def nvmlDeviceGetName(self, handle: _Handle) -> str:
        return self._gpu(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:
        return self._gpu(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> SimpleNamespace:
        g = self._gpu(handle, "nvmlDeviceGetMemoryInfo")
        total, used = g.memory_total_mb << 20, g.memory_used_mb << 20
        return SimpleNamespace(total=total, free=total - used, used=used)

    # -- pynvml: health ------------------------------------------------------------------

    def nvmlDeviceGetTemperature(self, handle: _Handle, sensor: int) -> int:
        g = self._gpu(handle, "nvmlDeviceGetTemperature")
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return g.temp_c

    def nvmlDeviceGetPowerUsage(self, handle: _Handle) -> int:
        return self._gpu(handle, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetUtilizationRates(self, handle: _Handle) -> SimpleNamespace:
        g = self._gpu(handle, "nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=g.util_pct, memory=g.util_pct // 2)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: _Handle) -> int:
        return self._gpu(handle, "nvmlDeviceGetCurrentClocksEventReasons").clock_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: _Handle) -> int:
        return self._gpu(handle, "nvmlDeviceGetCurrentClocksThrottleReasons").clock_reasons

    def nvmlDeviceGetTotalEccErrors(self, handle: _Handle, error_type: int, counter: int) -> int:
        g = self._gpu(handle, "nvmlDeviceGetTotalEccErrors")
        return g.ecc.get((error_type, counter), 0)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: _Handle) -> int:
        g = self._gpu(handle, "nvmlDeviceGetRetiredPagesPendingStatus")
        return NVML_FEATURE_ENABLED if g.retired_pages_pending else NVML_FEATURE_DISABLED

    def nvmlDeviceGetRemappedRows(self, handle: _Handle) -> tuple[int, int, int, int]:
        r = self._gpu(handle, "nvmlDeviceGetRemappedRows").remap
        return (r[0], r[1], r[2], r[3])

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: _Handle, link: int, counter: int) -> int:
        g = self._gpu(handle, "nvmlDeviceGetNvLinkErrorCounter")
        if g.nvlinks == 0:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < min(g.nvlinks, NVML_NVLINK_MAX_LINKS) or not 0 <= counter <= 4:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return g.nvlink_errors[(link, counter)]

    def nvmlDeviceGetPcieReplayCounter(self, handle: _Handle) -> int:
        return self._gpu(handle, "nvmlDeviceGetPcieReplayCounter").pcie_replay

    def nvmlDeviceGetFieldValues(self, handle: _Handle, field_ids: list[int]) -> list[_FieldValue]:
        g = self._gpu(handle, "nvmlDeviceGetFieldValues")
        values = []
        for fid in field_ids:
            # Script "not supported" with errors["NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"].
            ok = fid == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and _RECOVERY not in g.errors
            status = NVML_SUCCESS if ok else NVML_ERROR_NOT_SUPPORTED
            value = SimpleNamespace(uiVal=g.recovery_action if ok else 0)
            values.append(_FieldValue(fid, NVML_VALUE_TYPE_UNSIGNED_INT, status, value))
        return values

    # -- pynvml: events ------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> _EventSet:
        self._check()
        with self._lock:
            self._sets.append(event_set := _EventSet())
        return event_set

    def nvmlDeviceRegisterEvents(self, handle: _Handle, types: int, event_set: _EventSet) -> None:
        self._gpu(handle, "nvmlDeviceRegisterEvents")
        with self._lock:
            event_set.masks[handle.index] = event_set.masks.get(handle.index, 0) | types

    def nvmlEventSetWait_v2(self, event_set: _EventSet, timeout_ms: int) -> _EventData:
        self._check()
        self.calls["nvmlEventSetWait_v2"] += 1
        deadline = time.monotonic() + timeout_ms / 1000
        with self._lock:
            while True:
                self._run_due()
                if event_set.queue:
                    return event_set.queue.popleft()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NVMLError(NVML_ERROR_TIMEOUT)
                # Short waits, so actions scheduled with ``after`` fire on time.
                self._lock.wait(min(left, 0.01))

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:
        with self._lock:
            self._sets.remove(event_set)

    # -- internals -----------------------------------------------------------------------

    def _check(self) -> None:
        if self.initialized <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def _run_due(self) -> None:
        now = time.monotonic() - self._started
        due = [a for a in self._due if a[0] <= now]
        if due:
            self._due = [a for a in self._due if a[0] > now]
            for _, action in due:
                action()

    def _gpu(self, handle: _Handle, fn: str) -> FakeGpu:
        self._check()
        self.calls[fn] += 1
        with self._lock:
            self._run_due()
            gpu = self.gpus[handle.index]
            hang_s, lost, error = gpu.hang_s, gpu.lost, gpu.errors.get(fn)
        if hang_s:
            time.sleep(hang_s)
        if lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        if error is not None:
            raise NVMLError(error)
        return gpu


@dataclass(frozen=True)
class _Handle:
    index: int


@dataclass
class _EventData:  # c_nvmlEventData_t
    device: _Handle
    eventType: int
    eventData: int
    gpuInstanceId: int = 0xFFFFFFFF  # outside MIG
    computeInstanceId: int = 0xFFFFFFFF


@dataclass
class _FieldValue:  # c_nvmlFieldValue_t
    fieldId: int
    valueType: int
    nvmlReturn: int
    value: SimpleNamespace  # c_nvmlValue_t: dVal, uiVal, ullVal, ...
    scopeId: int = 0
    timestamp: int = 0
    latencyUsec: int = 0


# -- named scenarios, for processes and `--once` ------------------------------------------


def scenario(name: str) -> FakeNvml:
    """``healthy``; ``faults`` (4 GPUs: an NVLink replay burst on 0, a double-bit ECC
    error on 1, a row-remap failure on 2, thermal throttling on 3, and GPU 1 falling
    off the bus 1.5 s in); ``no-driver``; ``no-gpu``."""
    if name == "healthy":
        return FakeNvml(2)
    if name == "faults":
        fake = FakeNvml(4)
        fake.gpus[0].nvlink_errors[(3, NVML_NVLINK_ERROR_DL_REPLAY)] = 5000
        fake.double_bit_ecc(1)
        fake.row_remap_failure(2)
        fake.gpus[2].recovery_action = NVML_GPU_RECOVERY_ACTION_GPU_RESET
        fake.thermal_throttle(3)
        fake.after(1.5, lambda: fake.fall_off_bus(1))
        return fake
    if name == "no-driver":
        return FakeNvml(init_error=NVML_ERROR_DRIVER_NOT_LOADED)
    if name == "no-gpu":
        return FakeNvml(0)
    raise ValueError(f"unknown scenario {name!r}")


def main(argv: list[str] | None = None) -> int:
    from tmd.agent import agent
    from tmd.errors import ConfigError, TmdError

    p = argparse.ArgumentParser(prog="python -m tests.fakes.nvml")
    p.add_argument("--scenario", default="healthy")
    p.add_argument("--config")
    p.add_argument("--once", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        lib = scenario(args.scenario)
        return agent.run(args.config, once=args.once, as_json=args.json, lib=lib)
    except ConfigError as exc:  # as tmd.cli reports them
        print(f"tmd: config error: {exc}", file=sys.stderr)
        return 2
    except TmdError as exc:
        print(f"tmd: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
