"""Where the proof ran, said from the device: the architecture and ISA features in the self-test report, health and
the fleet's facts (on arm64 under qemu, /proc/cpuinfo shows the x86 host: the report must not take it)."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from agent.proof import isa
from agent.proof.probe import device_fingerprint


def test_this_machine_says_its_architecture_and_the_features_that_change_kernels() -> None:
    got = isa.cpu_isa()
    assert got["machine"] == platform.machine()
    if got["machine"] == "x86_64":
        flags = set(Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split())
        assert got["from"] == "cpuinfo"
        assert got["features"] == [f for f in isa.X86_FEATURES if f in flags]
    assert device_fingerprint()["isa"] == isa.isa_line()


def test_on_arm64_the_fingerprint_takes_hwcap_never_the_hosts_cpuinfo(monkeypatch: pytest.MonkeyPatch) -> None:
    """qemu-user shows the host's /proc/cpuinfo to an aarch64 process: its x86 `flags` and `model name` are not
    this device's, and before this they went into the report and the verdict cache key."""
    monkeypatch.setattr(isa.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(isa, "_hwcap_features", lambda: ["asimd", "asimddp"])
    isa.cpu_isa.cache_clear()
    try:
        fp = device_fingerprint()
        assert fp["isa"] == "aarch64: asimd asimddp"
        assert "flags" not in fp and "model_name" not in fp
    finally:
        isa.cpu_isa.cache_clear()


def test_health_and_facts_carry_the_device_isa() -> None:
    from agent.fleet.facts import device_facts
    from agent.link.health import build_health

    health = build_health(device_id="d", uptime_s=1, session=1, interval_s=10, serving=False, not_serving_reason=None,
                          engine=None, placement=None, selftest=None, pipeline=None, source=None, outbox=None,
                          process={}, mqtt_connected=None, update=None)
    assert health["device"] == isa.cpu_isa()
    facts = device_facts(device_id="d", session=1, labels={}, versions={}, report=None, effective=None, current=None,
                         committed=None, active=None, last_failure=None, device=isa.cpu_isa())
    assert facts["device"]["machine"] == platform.machine()
