"""``--gpu`` and the Vulkan backend's availability errors, without needing a device.

The loader, the instance and the CUDA probe are replaced by fakes, so these run
(and must pass) on any machine: a missing ``vulkan`` package or loader is a
clear ``BackendUnavailable`` for ``--gpu vulkan`` and a fall-back to the CPU
for ``--gpu auto``; ``auto`` passes over a Vulkan device that is a CPU
(lavapipe) and takes a Vulkan GPU.
"""

from __future__ import annotations

import io
import sys

import pytest

import opencoti.engine.backend as backend
from opencoti.engine.backend import BackendUnavailable, select_backend
from opencoti.engine.backend import vk_runtime


@pytest.fixture
def fresh(monkeypatch):
    """No cached backends or printed decisions; CUDA unavailable; returns the log."""
    monkeypatch.setattr(backend, "_instances", {})
    monkeypatch.setattr(backend, "_said", set())

    def no_cuda(device=0):
        raise BackendUnavailable("no CUDA here")

    monkeypatch.setitem(backend.BACKENDS, "cuda", no_cuda)
    return io.StringIO()


def _fake_instance(monkeypatch, devices):
    inst = type("FakeInstance", (), {"devices": devices})()
    monkeypatch.setattr(vk_runtime._Instance, "get", classmethod(lambda cls: inst))


def test_missing_vulkan_package(fresh, monkeypatch):
    monkeypatch.setitem(sys.modules, "vulkan", None)  # import vulkan -> ImportError
    monkeypatch.setattr(vk_runtime._Instance, "_one", None)
    with pytest.raises(BackendUnavailable, match=r"pip install 'opencoti\[vulkan\]'"):
        select_backend("vulkan", log=fresh)
    b = select_backend("auto", log=fresh)
    assert b.name == "cpu"
    assert "using the CPU" in fresh.getvalue() and "vulkan package" in fresh.getvalue()


def test_missing_loader(fresh, monkeypatch):
    def no_loader():
        raise vk_runtime.VulkanUnavailable("no Vulkan loader (libvulkan.so.1): install libvulkan1")

    monkeypatch.setattr(vk_runtime, "_import_vulkan", no_loader)
    monkeypatch.setattr(vk_runtime._Instance, "_one", None)
    for name in ("vulkan", "vk", "amd", "intel"):
        with pytest.raises(BackendUnavailable, match="no Vulkan loader"):
            select_backend(name, log=fresh)
    assert select_backend("auto", log=fresh).name == "cpu"
    assert "no Vulkan loader" in fresh.getvalue()


def test_no_device_and_bad_index(fresh, monkeypatch):
    _fake_instance(monkeypatch, [])
    with pytest.raises(BackendUnavailable, match="no Vulkan device"):
        select_backend("vulkan", log=fresh)
    assert select_backend("auto", log=fresh).name == "cpu"
    cpu_dev = vk_runtime.DeviceInfo(0, "llvmpipe", vk_runtime.TYPE_CPU, "1.3.0", 0x10005)
    _fake_instance(monkeypatch, [cpu_dev])
    with pytest.raises(BackendUnavailable, match="--main-gpu 3 out of range: 1 Vulkan device"):
        select_backend("vulkan", main_gpu=3, log=fresh)


def test_auto_passes_over_a_cpu_driver_and_takes_a_gpu(fresh, monkeypatch):
    cpu_dev = vk_runtime.DeviceInfo(0, "llvmpipe (LLVM 15.0.6, 256 bits)", vk_runtime.TYPE_CPU, "1.3.230", 0x10005)
    _fake_instance(monkeypatch, [cpu_dev])
    assert select_backend("auto", log=fresh).name == "cpu"
    assert "only a CPU Vulkan driver (llvmpipe" in fresh.getvalue()

    gpu_dev = vk_runtime.DeviceInfo(0, "Fake GPU", 2, "1.3.0", 0x1002)
    _fake_instance(monkeypatch, [gpu_dev, cpu_dev])
    made = []

    def fake_vulkan(device=0):
        made.append(device)
        return type("FakeVk", (), {"name": "vulkan", "device_name": "Fake GPU (discrete GPU, Vulkan 1.3.0)"})()

    monkeypatch.setitem(backend.BACKENDS, "vulkan", fake_vulkan)
    b = select_backend("auto", log=fresh)
    assert b.name == "vulkan" and made == [0]
    assert "--gpu auto: using Vulkan device 0 (Fake GPU" in fresh.getvalue()
    assert select_backend("disable", log=fresh).name == "cpu"
    assert select_backend("vulkan", n_gpu_layers=0, log=fresh).name == "cpu"


def test_unknown_gpu_lists_the_choices(fresh):
    with pytest.raises(BackendUnavailable, match="available: auto, nvidia, vulkan, vk, amd, intel, disable"):
        select_backend("apple", log=fresh)
