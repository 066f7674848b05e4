"""The devices option: parsing, the variable per backend, and when it can no longer change."""

from __future__ import annotations

import pytest

from xshard.backends import VisibleDevicesError, apply_visible_devices, backend_class, parse_devices

pytest_plugins = ("support.fakes.fixtures",)  # fixtures: fake_npu, make_fake_npu, no_torch_npu, no_xla


@pytest.mark.parametrize("spec,ids", [
    ("0,2", [0, 2]), (" 1 , 3 ", [1, 3]), ([0, 2], [0, 2]), ((5,), [5]), (3, [3]), ("7", [7]),
    (None, None), ("", None), ([], None),
])
def test_parse(spec, ids) -> None:
    assert parse_devices(spec) == ids


@pytest.mark.parametrize("spec,message", [
    ("-1", "-1 is negative"),
    ([0, -2], "-2 is negative"),
    ("0,0", "device 0 is listed twice"),
    ("a,1", "'a' is not a device index"),
    ("0,,1", "'' is not a device index"),
    ([0, 1.5], "1.5 is not a device index"),
    (True, "is not a device list"),
    (2.0, "is not a device list"),
])
def test_bad_values_name_the_entry(spec, message: str) -> None:
    with pytest.raises(VisibleDevicesError, match=message.replace("(", r"\(")):
        parse_devices(spec)


def test_each_backend_uses_its_own_variable(make_fake_npu) -> None:
    make_fake_npu()
    env: dict[str, str] = {}
    apply_visible_devices(backend_class("cuda"), "1,0", env)
    apply_visible_devices(backend_class("npu"), "1,0", env)
    assert env == {"CUDA_VISIBLE_DEVICES": "1,0", "ASCEND_RT_VISIBLE_DEVICES": "0,1"}


def test_backend_without_device_selection_sets_nothing() -> None:
    env: dict[str, str] = {}
    assert apply_visible_devices(backend_class("cpu"), "0,1", env) == {}
    assert env == {}
    with pytest.raises(VisibleDevicesError):
        apply_visible_devices(backend_class("cpu"), "0,x", env)  # still validated


def test_exported_value_that_differs_is_a_conflict_naming_both() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "3"}
    with pytest.raises(VisibleDevicesError, match=r"CUDA_VISIBLE_DEVICES=0,1.*already has CUDA_VISIBLE_DEVICES=3"):
        apply_visible_devices(backend_class("cuda"), [0, 1], env)
    assert env == {"CUDA_VISIBLE_DEVICES": "3"}
    assert apply_visible_devices(backend_class("cuda"), None, env) == {}


def test_npu_runtime_started_refuses_a_change(make_fake_npu) -> None:
    make_fake_npu(initialized=True)
    with pytest.raises(VisibleDevicesError, match="npu runtime has already started with ASCEND_RT_VISIBLE_DEVICES unset"):
        apply_visible_devices(backend_class("npu"), "2,3", {})
