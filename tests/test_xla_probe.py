"""How the XLA backend decides it may run, without starting torch_xla (runs with or without it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from xshard.backends.devices.xla import XLABackend, cpu_replicas_env, tpu_detected


def _pci(root: Path, name: str, vendor: str, device: str) -> None:
    entry = root / name
    entry.mkdir(parents=True)
    (entry / "vendor").write_text(vendor + "\n")
    (entry / "device").write_text(device + "\n")


def test_a_tpu_chip_is_told_apart_from_googles_network_card(tmp_path: Path) -> None:
    _pci(tmp_path, "0000:00:04.0", "0x1ae0", "0x0042")  # gVNIC, on every GCE VM
    _pci(tmp_path, "0000:00:05.0", "0x8086", "0x1237")
    assert not tpu_detected(tmp_path)
    _pci(tmp_path, "0000:00:06.0", "0x1ae0", "0x005e")  # TPU v4
    assert tpu_detected(tmp_path)
    assert not tpu_detected(tmp_path / "missing")


@pytest.mark.skipif(tpu_detected(), reason="this machine has a TPU")
def test_auto_passes_over_xla_on_the_cpu_and_names_the_explicit_choice(clean_env) -> None:
    clean_env.setenv("PJRT_DEVICE", "CPU")
    reason = XLABackend.auto_skip_reason()
    assert reason is not None and "XSHARD_BACKEND=xla" in reason
    clean_env.setenv("PJRT_DEVICE", "TPU")
    assert XLABackend.auto_skip_reason() is None


def test_cpu_replicas_env_sizes_the_execution_pool_for_every_replica() -> None:
    env = cpu_replicas_env(64)
    assert (env["PJRT_DEVICE"], env["CPU_NUM_DEVICES"]) == ("CPU", "64")
    assert int(env["XLA_THREAD_POOL_SIZE"]) >= 8 * 64
    with pytest.raises(ValueError, match="at least 1"):
        cpu_replicas_env(0)
