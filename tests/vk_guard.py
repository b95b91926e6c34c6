"""Whether a Vulkan device exists, for the Vulkan test modules (their shared fixtures
``vk`` and ``gpu_paths`` are in ``conftest.py``): without one they skip, unless
``OPENCOTI_REQUIRE_VULKAN=1`` (set by ``.ci/run``, which installs Mesa's lavapipe) turns the
missing device into a failure. ``OPENCOTI_VK_DEVICE`` picks the device index (default 0)."""

from __future__ import annotations

import os

import pytest

from opencoti.engine.backend import BackendUnavailable

DEVICE = int(os.environ.get("OPENCOTI_VK_DEVICE", "0"))


def vulkan_devices(module_level: bool = True) -> list:
    """The Vulkan devices (``vk_runtime.list_devices``). With none: ``RuntimeError`` when
    ``OPENCOTI_REQUIRE_VULKAN`` is set, else skip the calling module (``module_level``,
    at import) or test."""
    try:
        from opencoti.engine.backend.vk_runtime import list_devices

        devs = list_devices()
        if not devs:
            raise BackendUnavailable("no Vulkan device")
        return devs
    except BackendUnavailable as e:
        if os.environ.get("OPENCOTI_REQUIRE_VULKAN", "0") not in ("", "0"):
            raise RuntimeError(f"OPENCOTI_REQUIRE_VULKAN is set but Vulkan is unavailable: {e}") from None
        pytest.skip(f"no Vulkan device ({e})", allow_module_level=module_level)

