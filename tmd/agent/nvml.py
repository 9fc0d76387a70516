"""The one adapter over NVML (nvidia-ml-py, module ``pynvml``).

Owns everything NVML-specific in tmd: init and shutdown with errors a person can act
on, the GPU inventory, one health sample of every GPU as ``wire.GpuSample``, and the
XID event set. The agent sees typed wire values and ``NvmlError``, never pynvml.

Every getter tolerates a device or driver that lacks it (``NVMLError_NotSupported``,
or ``NVMLError_FunctionNotFound`` from an older driver, or a binding too old to have
the function): the field is None. Any other NVML error on one getter is recorded in
``Sample.errors`` and the field is None, so one failing counter never hides the rest.

The pynvml-like library is a parameter (``Nvml.open(lib)``): tests pass the fake in
``tests/fakes/nvml.py``. pynvml itself is imported only when no library is given, so
the daemon and the test suite do not need it. NVML calls can block for seconds on a
GPU that is falling off the bus: callers run them in a thread with a timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tmd import wire
from tmd.errors import TmdError

_MIB = 1 << 20


class NvmlError(TmdError):
    """An NVML call failed in a way the caller must handle (not a missing feature)."""


class NvmlUnavailable(NvmlError):
    """NVML cannot be used on this node: no bindings, no driver, no GPU."""


@dataclass(frozen=True)
class Sample:
    gpus: list[wire.GpuSample]
    # (gpu index, field) -> NVML error text, for getters that failed unexpectedly.
    errors: dict[tuple[int, str], str] = field(default_factory=dict)


@dataclass(frozen=True)
class Xid:
    gpu: int | None  # None: the driver named a device we could not map to an index
    xid: int
    ts: float


class Nvml:
    """An initialised NVML; ``close`` shuts it down. Build with ``Nvml.open``."""

    def __init__(self, lib: Any, handles: list[Any], gpus: list[wire.GpuInfo], driver: str):
        self._lib = lib
        self._handles = handles
        self.gpus = gpus
        self.driver_version = driver
        # Links whose error counters answer, per GPU; probed on the first sample.
        self._links: dict[int, tuple[int, ...]] = {}
        self._quiet = {_code(lib, "NOT_SUPPORTED"), _code(lib, "FUNCTION_NOT_FOUND")}
        self._value_attr = {
            getattr(lib, f"NVML_VALUE_TYPE_{kind}", -1 - i): attr
            for i, (kind, attr) in enumerate(
                (
                    ("DOUBLE", "dVal"),
                    ("UNSIGNED_INT", "uiVal"),
                    ("UNSIGNED_LONG", "ulVal"),
                    ("UNSIGNED_LONG_LONG", "ullVal"),
                    ("SIGNED_LONG_LONG", "sllVal"),
                    ("SIGNED_INT", "siVal"),
                    ("UNSIGNED_SHORT", "usVal"),
                )
            )
        }

    @classmethod
    def open(cls, lib: Any = None) -> Nvml:
        """``nvmlInit`` and the inventory. Raises NvmlUnavailable saying what is missing."""
        if lib is None:
            try:
                import pynvml

                lib = pynvml
            except ImportError:
                raise NvmlUnavailable(
                    "the nvidia-ml-py package (module pynvml) is not installed: "
                    "pip install 'tmd[agent]'"
                ) from None
        try:
            lib.nvmlInit()
        except lib.NVMLError as exc:
            raise NvmlUnavailable(_init_failure(lib, exc)) from None
        try:
            count = lib.nvmlDeviceGetCount()
            if count == 0:
                raise NvmlUnavailable("NVML found no GPU on this node")
            handles = [lib.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            driver = _text(_call_or(lib, "nvmlSystemGetDriverVersion", ""))
            gpus = [_info(lib, i, h) for i, h in enumerate(handles)]
        except BaseException as exc:
            _shutdown_quietly(lib)
            if isinstance(exc, lib.NVMLError):
                raise NvmlUnavailable(f"NVML cannot list the GPUs: {exc}") from None
            raise
        return cls(lib, handles, gpus, driver)

    def close(self) -> None:
        _shutdown_quietly(self._lib)

    # -- one sample ----------------------------------------------------------------------

    def sample(self) -> Sample:
        """Every GPU once. Blocks: call it from a thread."""
        errors: dict[tuple[int, str], str] = {}
        return Sample([self._sample_gpu(i, h, errors) for i, h in enumerate(self._handles)], errors)

    def _sample_gpu(self, i: int, h: Any, errors: dict[tuple[int, str], str]) -> wire.GpuSample:
        lib = self._lib

        def get(name: str, fn: str, *args: Any) -> Any:
            return self._get(fn, (h, *args), errors, (i, name))

        power = get("power_w", "nvmlDeviceGetPowerUsage")  # milliwatts
        util = get("util_pct", "nvmlDeviceGetUtilizationRates")
        memory = get("mem_used_mb", "nvmlDeviceGetMemoryInfo")
        reasons = get("clock_event_reasons", "nvmlDeviceGetCurrentClocksEventReasons")
        if reasons is None:
            # Bindings or drivers from before the rename (12.535) only have the old name.
            reasons = get("clock_event_reasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
        corrected = lib.NVML_MEMORY_ERROR_TYPE_CORRECTED
        uncorrected = lib.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        volatile, aggregate = lib.NVML_VOLATILE_ECC, lib.NVML_AGGREGATE_ECC
        ecc = "nvmlDeviceGetTotalEccErrors"
        retired = get("retired_pages_pending", "nvmlDeviceGetRetiredPagesPendingStatus")
        remap = get("remap", "nvmlDeviceGetRemappedRows")  # (corr, unc, pending, failure)
        nvlink = self._nvlink(i, h, errors)
        return wire.GpuSample(
            index=i,
            temp_c=_float(get("temp_c", "nvmlDeviceGetTemperature", lib.NVML_TEMPERATURE_GPU)),
            power_w=None if power is None else power / 1000.0,
            util_pct=None if util is None else float(util.gpu),
            mem_used_mb=None if memory is None else int(memory.used) // _MIB,
            clock_event_reasons=reasons,
            ecc_sbe_volatile=get("ecc_sbe_volatile", ecc, corrected, volatile),
            ecc_dbe_volatile=get("ecc_dbe_volatile", ecc, uncorrected, volatile),
            ecc_sbe_aggregate=get("ecc_sbe_aggregate", ecc, corrected, aggregate),
            ecc_dbe_aggregate=get("ecc_dbe_aggregate", ecc, uncorrected, aggregate),
            retired_pages_pending=None if retired is None else bool(retired),
            remap_pending=None if remap is None else bool(remap[2]),
            remap_failure=None if remap is None else bool(remap[3]),
            nvlink_replay=nvlink[0],
            nvlink_recovery=nvlink[1],
            nvlink_crc=nvlink[2],
            pcie_replay=get("pcie_replay", "nvmlDeviceGetPcieReplayCounter"),
            recovery_action=self._recovery_action(i, h, errors),
        )

    def _get(
        self, fn: str, args: tuple[Any, ...], errors: dict[tuple[int, str], str], key: Any
    ) -> Any:
        call = getattr(self._lib, fn, None)
        if call is None:
            return None  # bindings too old to know the function
        try:
            return call(*args)
        except self._lib.NVMLError as exc:
            if exc.value not in self._quiet:
                errors[key] = f"{fn}: {exc}"
            return None

    def _nvlink(
        self, i: int, h: Any, errors: dict[tuple[int, str], str]
    ) -> tuple[int | None, int | None, int | None]:
        lib = self._lib
        links = self._links.get(i)
        if links is None:
            links = self._probe_links(h, errors, i)
        if not links:
            return (None, None, None)
        counters = (
            lib.NVML_NVLINK_ERROR_DL_REPLAY,
            lib.NVML_NVLINK_ERROR_DL_RECOVERY,
            lib.NVML_NVLINK_ERROR_DL_CRC_FLIT,
        )
        totals: list[int | None] = []
        names = ("nvlink_replay", "nvlink_recovery", "nvlink_crc")
        for name, counter in zip(names, counters, strict=True):
            values = [
                self._get("nvmlDeviceGetNvLinkErrorCounter", (h, link, counter), errors, (i, name))
                for link in links
            ]
            known = [v for v in values if v is not None]
            totals.append(sum(known) if known else None)
        return (totals[0], totals[1], totals[2])

    def _probe_links(self, h: Any, errors: dict[tuple[int, str], str], i: int) -> tuple[int, ...]:
        """Links 0..NVML_NVLINK_MAX_LINKS-1 whose replay counter answers. A link the GPU
        lacks says NotSupported or InvalidArgument; remembered unless something else
        failed, so a GPU without NVLink costs these calls once, not every second."""
        lib = self._lib
        absent = {*self._quiet, _code(lib, "INVALID_ARGUMENT")}
        links: list[int] = []
        unsure = False
        for link in range(lib.NVML_NVLINK_MAX_LINKS):
            try:
                lib.nvmlDeviceGetNvLinkErrorCounter(h, link, lib.NVML_NVLINK_ERROR_DL_REPLAY)
            except lib.NVMLError as exc:
                if exc.value not in absent:
                    unsure = True
                    errors[(i, "nvlink_replay")] = f"nvmlDeviceGetNvLinkErrorCounter: {exc}"
                continue
            links.append(link)
        if not unsure:
            self._links[i] = tuple(links)
        return tuple(links)

    def _recovery_action(self, i: int, h: Any, errors: dict[tuple[int, str], str]) -> int | None:
        field_id = getattr(self._lib, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field_id is None:
            return None  # bindings older than the field (driver 570)
        values = self._get("nvmlDeviceGetFieldValues", (h, [field_id]), errors, (i, "recovery"))
        if not values:
            return None
        value = values[0]
        if value.nvmlReturn != self._lib.NVML_SUCCESS:
            return None  # per-field status: this driver or GPU has no recovery action
        attr = self._value_attr.get(value.valueType)
        return None if attr is None else int(getattr(value.value, attr))

    # -- XID events ----------------------------------------------------------------------

    def xid_events(self) -> XidEvents | None:
        """An event set registered for XID critical errors on every GPU that has them;
        None when no GPU does (the agent then only samples)."""
        lib = self._lib
        try:
            event_set = lib.nvmlEventSetCreate()
        except lib.NVMLError as exc:
            if exc.value in self._quiet:
                return None
            raise NvmlError(f"nvmlEventSetCreate: {exc}") from None
        registered = []
        for i, h in enumerate(self._handles):
            try:
                lib.nvmlDeviceRegisterEvents(h, lib.nvmlEventTypeXidCriticalError, event_set)
            except lib.NVMLError as exc:
                if exc.value not in self._quiet:
                    _call_or(lib, "nvmlEventSetFree", None, event_set)
                    raise NvmlError(f"nvmlDeviceRegisterEvents(gpu {i}): {exc}") from None
                continue
            registered.append(i)
        if not registered:
            _call_or(lib, "nvmlEventSetFree", None, event_set)
            return None
        uuids = {info.uuid: info.index for info in self.gpus if info.uuid}
        return XidEvents(lib, event_set, registered, uuids)


class XidEvents:
    """A registered event set. ``wait`` blocks up to its timeout: use one thread."""

    def __init__(self, lib: Any, event_set: Any, gpus: list[int], uuids: dict[str, int]) -> None:
        self._lib = lib
        self._set = event_set
        self.gpus = gpus
        self._uuids = uuids
        self._wait: Callable[[Any, int], Any] = getattr(lib, "nvmlEventSetWait_v2", None) or (
            lib.nvmlEventSetWait
        )

    def wait(self, timeout_ms: int) -> Xid | None:
        """The next XID, or None after ``timeout_ms`` without one."""
        lib = self._lib
        try:
            data = self._wait(self._set, timeout_ms)
        except lib.NVMLError as exc:
            if exc.value == lib.NVML_ERROR_TIMEOUT:
                return None
            raise NvmlError(f"nvmlEventSetWait_v2: {exc}") from None
        ts = time.time()  # v2 events carry no time; this is when the driver handed it over
        if not data.eventType & lib.nvmlEventTypeXidCriticalError:
            return None
        return Xid(gpu=self._index(data.device), xid=int(data.eventData), ts=ts)

    def _index(self, device: Any) -> int | None:
        lib = self._lib
        try:
            return int(lib.nvmlDeviceGetIndex(device))
        except lib.NVMLError:
            pass
        try:
            return self._uuids.get(_text(lib.nvmlDeviceGetUUID(device)))
        except lib.NVMLError:
            return None

    def close(self) -> None:
        _call_or(self._lib, "nvmlEventSetFree", None, self._set)


# -- helpers ---------------------------------------------------------------------------


def _code(lib: Any, name: str) -> int:
    return int(getattr(lib, f"NVML_ERROR_{name}"))


def _init_failure(lib: Any, exc: Any) -> str:
    why = {
        _code(lib, "LIBRARY_NOT_FOUND"): "libnvidia-ml.so.1 not found: no NVIDIA driver installed",
        _code(lib, "DRIVER_NOT_LOADED"): "the NVIDIA kernel driver is not loaded",
        _code(lib, "NO_PERMISSION"): "no permission to open the NVIDIA devices (/dev/nvidia*)",
        _code(lib, "LIB_RM_VERSION_MISMATCH"): (
            "the NVML library and the loaded kernel driver differ in version "
            "(reload the driver or reboot)"
        ),
    }.get(exc.value, "nvmlInit failed")
    return f"{why} (NVML: {exc})"


def _info(lib: Any, i: int, h: Any) -> wire.GpuInfo:
    memory = _call_or(lib, "nvmlDeviceGetMemoryInfo", None, h)
    return wire.GpuInfo(
        index=i,
        uuid=_text(_call_or(lib, "nvmlDeviceGetUUID", "", h))[:256],
        name=_text(_call_or(lib, "nvmlDeviceGetName", "", h))[:256],
        memory_mb=None if memory is None else int(memory.total) // _MIB,
    )


def _call_or(lib: Any, fn: str, default: Any, *args: Any) -> Any:
    """``fn(*args)``, or ``default`` when the bindings lack it or the device says no."""
    call = getattr(lib, fn, None)
    if call is None:
        return default
    try:
        return call(*args)
    except lib.NVMLError:
        return default


def _shutdown_quietly(lib: Any) -> None:
    # Shutdown failing (driver gone, GPU lost) leaves nothing for the caller to do.
    _call_or(lib, "nvmlShutdown", None)


def _text(value: Any) -> str:
    # Bindings before 11.515 return bytes; later ones decode.
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)
