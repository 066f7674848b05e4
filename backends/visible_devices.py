"""Which devices a job may use: the ``devices`` option mapped to the backend's own variable.

``devices="0,2"`` (or ``[0, 2]``) becomes ``CUDA_VISIBLE_DEVICES=0,2`` on cuda,
``ASCEND_RT_VISIBLE_DEVICES=0,2`` on npu (always ascending: HCCL builds its rank table from the
ordering and requires it), or whatever variable the backend names in ``visible_devices_env``.
Inside the job, local rank i then runs on the i-th listed device.

The vendor runtime reads the variable once, when it starts; setting it later silently does
nothing. So ``apply_visible_devices`` refuses to change it once the runtime is up, and refuses to
overwrite a different value the user exported (the same rule as XSHARD_BACKEND vs ``backend=``).
The launcher calls it before starting processes, the Accelerator before touching the device.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, MutableMapping

from ..errors import VisibleDevicesError
from .base import Backend

log = logging.getLogger("xshard.backends")

DevicesSpec = str | int | Iterable[int] | None


def parse_devices(devices: DevicesSpec) -> list[int] | None:
    """Normalise a devices option ("0,2", "0, 2", 3, [0, 2]) to a list of device indices.

    None or "" means "all devices" and returns None. Negative, duplicate or non-integer entries
    are errors that name the bad entry.
    """
    if devices is None:
        return None
    if isinstance(devices, bool):
        raise VisibleDevicesError(f"devices={devices!r} is not a device list: use e.g. devices='0,1' or [0, 1]")
    if isinstance(devices, int):
        items: list[object] = [devices]
    elif isinstance(devices, str):
        text = devices.strip()
        if text == "":
            return None
        items = [part.strip() for part in text.split(",")]
    else:
        try:
            items = list(devices)
        except TypeError:
            raise VisibleDevicesError(
                f"devices={devices!r} is not a device list: use e.g. devices='0,1' or [0, 1]"
            ) from None
    if not items:
        return None
    ids: list[int] = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int | str):
            raise VisibleDevicesError(f"devices={devices!r}: {item!r} is not a device index (a whole number >= 0)")
        try:
            index = int(item)
        except ValueError:
            raise VisibleDevicesError(
                f"devices={devices!r}: {item!r} is not a device index (a whole number >= 0); "
                "write the list as e.g. '0,1'"
            ) from None
        if index < 0:
            raise VisibleDevicesError(f"devices={devices!r}: {index} is negative; device indices start at 0")
        if index in ids:
            raise VisibleDevicesError(f"devices={devices!r}: device {index} is listed twice")
        ids.append(index)
    return ids


def visible_devices_value(backend_cls: type[Backend], devices: DevicesSpec) -> str | None:
    """The value ``backend_cls``'s visible-devices variable should have, or None for "all"."""
    ids = parse_devices(devices)
    if ids is None:
        return None
    return backend_cls.format_visible_devices(ids)


def apply_visible_devices(
    backend_cls: type[Backend], devices: DevicesSpec, env: MutableMapping[str, str] | None = None
) -> dict[str, str]:
    """Set ``backend_cls``'s visible-devices variable in ``env`` from ``devices``.

    Returns the variables it set (empty when ``devices`` is None, the value is already in effect,
    or the backend has no such variable). Raises VisibleDevicesError for a bad value, for a
    different value already exported, and for any change once the vendor runtime has started.
    """
    env = os.environ if env is None else env
    value = visible_devices_value(backend_cls, devices)
    if value is None:
        return {}
    var = backend_cls.visible_devices_env
    if var is None:
        log.info("devices=%r ignored: the %s backend has no device selection", devices, backend_cls.name)
        return {}
    current = env.get(var)
    if current == value:
        return {}
    if backend_cls.runtime_initialized():
        raise VisibleDevicesError(
            f"devices={devices!r} needs {var}={value}, but the {backend_cls.name} runtime has already started"
            + (f" with {var}={current}" if current is not None else f" with {var} unset")
            + ": the runtime reads it only once. Set the devices before the first use of the device "
            f"(create the Accelerator first, or export {var}={value} before starting Python)"
        )
    if current is not None:
        raise VisibleDevicesError(
            f"devices={devices!r} asks for {var}={value}, but the environment already has {var}={current}: "
            "remove one of them, or make them agree"
        )
    env[var] = value
    log.info("%s=%s (from devices=%r)", var, value, devices)
    return {var: value}
