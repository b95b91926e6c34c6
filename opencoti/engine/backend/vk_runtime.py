"""Vulkan runtime for the Vulkan backend: device, memory, pipelines, recording.

Through the ``vulkan`` package (CFFI bindings to the Vulkan loader,
``libvulkan.so.1``); setup uses its struct helpers, the per-dispatch path calls
the C functions directly (``vulkan.lib``), which costs well under a microsecond
per call.

Execution model (as a CUDA stream): every operation is *recorded* into one
command buffer; ``flush`` submits it with a fence and waits. A forward pass is
one submission: ``download`` (the logits) is what flushes. Hazards between
recorded commands are tracked per byte range of the device blocks: a pipeline
barrier goes in before a command that reads or writes what an earlier command
since the last barrier wrote, or writes what one read (read-after-write,
write-after-write, write-after-read); independent dispatches (q, k and v
projections) run without one. Because of that ordering, device memory of a
tensor that Python frees while commands that use it are still pending can be
handed out again at once: its next user is ordered after them.

Memory: device-local *blocks* (``BLOCK_BYTES``, one ``VkBuffer`` each, or one
block per larger request) sub-allocated best-fit with coalescing, ``align``-byte
aligned (>= ``minStorageBufferOffsetAlignment``); a host-visible *staging* ring
for uploads (reset after each flush) and a *readback* buffer for downloads.
Uploads of up to 64 KiB go into the command buffer itself (``vkCmdUpdateBuffer``).

A storage-buffer binding may span at most ``max_range`` bytes
(``maxStorageBufferRange``: 128 MiB on lavapipe, 4 GiB on NVIDIA); callers bind
windows of larger buffers (see ``VulkanBackend.mul_mat``).

Graphs (``CommandGraph``): dispatches can instead be recorded into a reusable
command buffer (``begin_capture`` / ``end_capture``) that owns its descriptor
sets and every allocation made meanwhile; ``run_graph`` submits the main buffer
(the step's input uploads, ``upload_prologue``), the graph and a copy of its
output to the host in one submission.

Pipelines: one per shipped SPIR-V module (``opencoti.vk_shaders``), created on
first use; all storage-buffer bindings in set 0 and 128 bytes of push constants.
Descriptor sets are cached by their exact bindings (block, offset, range), so a
decode step reuses the sets of the previous one.

Errors: ``VulkanUnavailable`` (a ``BackendUnavailable``) when the package, the
loader, a driver or the device is missing; ``VulkanError`` for a failed call.
"""

from __future__ import annotations

import bisect
import itertools
import sys
import threading
from dataclasses import dataclass

import numpy as np

from opencoti.engine.backend import BackendUnavailable

BLOCK_BYTES = 256 << 20
STAGING_BYTES = 64 << 20
READBACK_BYTES = 64 << 20
UPDATE_MAX = 65536  # vkCmdUpdateBuffer limit
PUSH_BYTES = 128
MAX_SETS = 4096
GRAPH_SETS = 2048  # descriptor sets one recorded graph may use
API_1_1 = (1 << 22) | (1 << 12)

# VkResult codes (vulkan_core.h)
_RESULTS = {0: "VK_SUCCESS", 1: "VK_NOT_READY", 2: "VK_TIMEOUT", -1: "VK_ERROR_OUT_OF_HOST_MEMORY",
            -2: "VK_ERROR_OUT_OF_DEVICE_MEMORY", -3: "VK_ERROR_INITIALIZATION_FAILED", -4: "VK_ERROR_DEVICE_LOST",
            -5: "VK_ERROR_MEMORY_MAP_FAILED", -6: "VK_ERROR_LAYER_NOT_PRESENT", -7: "VK_ERROR_EXTENSION_NOT_PRESENT",
            -8: "VK_ERROR_FEATURE_NOT_PRESENT", -9: "VK_ERROR_INCOMPATIBLE_DRIVER", -10: "VK_ERROR_TOO_MANY_OBJECTS",
            -12: "VK_ERROR_FRAGMENTED_POOL", -13: "VK_ERROR_UNKNOWN", -1000069000: "VK_ERROR_OUT_OF_POOL_MEMORY"}
_POOL_FULL = (-12, -1000069000)
DEVICE_TYPES = {0: "other", 1: "integrated GPU", 2: "discrete GPU", 3: "virtual GPU", 4: "CPU"}
TYPE_CPU = 4


class VulkanUnavailable(BackendUnavailable):
    """The Vulkan backend cannot run here; the message says what is missing."""


class VulkanError(RuntimeError):
    """A Vulkan call failed (the message names the call and the VkResult)."""


class GraphTooLarge(VulkanError):
    """A graph being recorded needs more descriptor sets than its pool holds."""


def _import_vulkan():
    """The ``vulkan`` module, or ``VulkanUnavailable`` saying what to install."""
    try:
        import vulkan
    except ImportError:
        raise VulkanUnavailable("the Vulkan backend needs the vulkan package: pip install 'opencoti[vulkan]'") from None
    except OSError:  # the package raises OSError when libvulkan.so.1 cannot be loaded
        raise VulkanUnavailable("no Vulkan loader (libvulkan.so.1): install libvulkan1 and a Vulkan driver "
                                "(mesa-vulkan-drivers, or the NVIDIA / AMD / Intel driver)") from None
    return vulkan


def pr_ver(v: int) -> tuple[int, int]:
    """(major, minor) of a packed Vulkan version."""
    return (v >> 22) & 0x7F, (v >> 12) & 0x3FF


def _check(res: int, what: str) -> None:
    if res != 0:
        raise VulkanError(f"{what} failed: {_RESULTS.get(res, res)}")


@dataclass
class DeviceInfo:
    """One Vulkan physical device, as ``--main-gpu`` indexes them (GPUs first, CPU devices last)."""

    index: int
    name: str
    type: int
    api_version: str
    vendor_id: int
    handle: object = None

    @property
    def is_cpu(self) -> bool:
        """A software rasterizer on the CPU (Mesa lavapipe / llvmpipe, SwiftShader)."""
        return self.type == TYPE_CPU

    @property
    def type_name(self) -> str:
        return DEVICE_TYPES.get(self.type, "other")


class _Instance:
    """A VkInstance (one per process, shared by every runtime)."""

    _lock = threading.Lock()
    _one = None

    def __init__(self):
        vk = self.vk = _import_vulkan()
        ffi = vk.ffi
        self._name = ffi.new("char[]", b"opencoti")
        app = ffi.new("VkApplicationInfo*", {"sType": vk.VK_STRUCTURE_TYPE_APPLICATION_INFO,
                                             "pApplicationName": self._name, "pEngineName": self._name,
                                             "apiVersion": API_1_1})
        info = ffi.new("VkInstanceCreateInfo*", {"sType": vk.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO,
                                                 "pApplicationInfo": app})
        out = ffi.new("VkInstance*")
        res = vk.lib.vkCreateInstance(info, ffi.NULL, out)
        if res != 0:
            raise VulkanUnavailable(f"cannot create a Vulkan instance ({_RESULTS.get(res, res)}): no usable "
                                    "Vulkan driver (ICD) is installed")
        self.handle = out[0]
        n = ffi.new("uint32_t*")
        _check(vk.lib.vkEnumeratePhysicalDevices(self.handle, n, ffi.NULL), "vkEnumeratePhysicalDevices")
        pds = ffi.new("VkPhysicalDevice[]", n[0])
        _check(vk.lib.vkEnumeratePhysicalDevices(self.handle, n, pds), "vkEnumeratePhysicalDevices")
        devs = []
        for i in range(n[0]):
            pr = ffi.new("VkPhysicalDeviceProperties*")
            vk.lib.vkGetPhysicalDeviceProperties(pds[i], pr)
            v = pr.apiVersion
            devs.append(DeviceInfo(0, ffi.string(pr.deviceName).decode("utf-8", "replace"), pr.deviceType,
                                   f"{v >> 22}.{(v >> 12) & 0x3FF}.{v & 0xFFF}", pr.vendorID, pds[i]))
        devs.sort(key=lambda d: d.is_cpu)  # stable: the loader's order, CPU devices last
        for i, d in enumerate(devs):
            d.index = i
        self.devices = devs

    @classmethod
    def get(cls) -> "_Instance":
        with cls._lock:
            if cls._one is None:
                cls._one = _Instance()
            return cls._one


def list_devices() -> list[DeviceInfo]:
    """The Vulkan devices of this machine in ``--main-gpu`` order. Raises ``VulkanUnavailable``."""
    return list(_Instance.get().devices)


class Block:
    """A device (or host-visible) memory allocation with one buffer over all of it."""

    _ids = itertools.count(1)

    def __init__(self, rt: "Runtime", size: int, host: bool = False):
        vk, ffi, lib = rt.vk, rt.ffi, rt.lib
        self.id = next(Block._ids)
        self.size = size
        usage = vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT | \
            vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT
        info = ffi.new("VkBufferCreateInfo*", {"sType": vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, "size": size,
                                               "usage": usage, "sharingMode": vk.VK_SHARING_MODE_EXCLUSIVE})
        out = ffi.new("VkBuffer*")
        _check(lib.vkCreateBuffer(rt.device, info, ffi.NULL, out), "vkCreateBuffer")
        self.buffer = out[0]
        req = ffi.new("VkMemoryRequirements*")
        lib.vkGetBufferMemoryRequirements(rt.device, self.buffer, req)
        if host:
            mt = rt.memory_type(req.memoryTypeBits, vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT
                                | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT, vk.VK_MEMORY_PROPERTY_HOST_CACHED_BIT)
        else:
            mt = rt.memory_type(req.memoryTypeBits, vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT, 0)
        ainfo = ffi.new("VkMemoryAllocateInfo*", {"sType": vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
                                                  "allocationSize": req.size, "memoryTypeIndex": mt})
        mem = ffi.new("VkDeviceMemory*")
        res = lib.vkAllocateMemory(rt.device, ainfo, ffi.NULL, mem)
        if res != 0:
            lib.vkDestroyBuffer(rt.device, self.buffer, ffi.NULL)
            raise VulkanError(f"vkAllocateMemory of {size / 2**20:.1f} MiB failed: {_RESULTS.get(res, res)}"
                              + (" (out of device memory)" if res in (-1, -2) else ""))
        self.memory = mem[0]
        _check(lib.vkBindBufferMemory(rt.device, self.buffer, self.memory, 0), "vkBindBufferMemory")
        self.mapped = None
        if host:
            p = ffi.new("void**")
            _check(lib.vkMapMemory(rt.device, self.memory, 0, size, 0, p), "vkMapMemory")
            self.mapped = np.frombuffer(ffi.buffer(p[0], size), dtype=np.uint8)
        self.free = [(0, size)]  # sorted (offset, size) free ranges

    def destroy(self, rt: "Runtime") -> None:
        if self.mapped is not None:
            self.mapped = None
            rt.lib.vkUnmapMemory(rt.device, self.memory)
        rt.lib.vkDestroyBuffer(rt.device, self.buffer, rt.ffi.NULL)
        rt.lib.vkFreeMemory(rt.device, self.memory, rt.ffi.NULL)


class Alloc:
    """``size`` bytes at ``offset`` of a device block; returned to the pool when garbage-collected."""

    __slots__ = ("rt", "block", "offset", "size", "__weakref__")

    def __init__(self, rt: "Runtime", block: Block, offset: int, size: int):
        self.rt, self.block, self.offset, self.size = rt, block, offset, size

    def __del__(self):
        try:
            self.rt._free(self)
        except Exception:  # interpreter shutdown
            pass


class CommandGraph:
    """A recorded command buffer that is submitted again and again (a decode step's
    forward pass, as a CUDA graph): its own descriptor pool and sets, and every
    allocation made while it was recorded (``retained``), so the memory its commands
    address stays its own for as long as it lives. ``tape`` and ``slots`` belong to
    the backend (the ops' results in call order; the inputs refreshed per step)."""

    def __init__(self, rt: "Runtime"):
        vk, ffi, lib = rt.vk, rt.ffi, rt.lib
        self.rt = rt
        ca = ffi.new("VkCommandBufferAllocateInfo*", {"sType": vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO,
                                                      "commandPool": rt.cmd_pool, "commandBufferCount": 1,
                                                      "level": vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY})
        cb = ffi.new("VkCommandBuffer[1]")
        _check(lib.vkAllocateCommandBuffers(rt.device, ca, cb), "vkAllocateCommandBuffers")
        self.cmd = cb[0]
        self.max_sets = GRAPH_SETS
        self.pool = rt._make_desc_pool(self.max_sets)
        self.sets: dict = {}
        self.retained: list = []
        self.reads: list = []
        self.writes: list = []
        self.tape: list = []
        self.tape_pos = 0
        self.slots: list = []
        self.out = None
        self.released = False

    def release(self) -> None:
        """Free the command buffer, the descriptor pool and the retained memory."""
        if self.released:
            return
        self.released = True
        rt = self.rt
        if not rt.closed:
            rt.lib.vkFreeCommandBuffers(rt.device, rt.cmd_pool, 1, rt.ffi.new("VkCommandBuffer[1]", [self.cmd]))
            rt.lib.vkDestroyDescriptorPool(rt.device, self.pool, rt.ffi.NULL)
        self.retained = []
        self.tape = []
        self.slots = []

    def __del__(self):
        try:
            self.release()
        except Exception:  # interpreter shutdown
            pass


class Runtime:
    """One Vulkan device: memory, pipelines and the command buffer being recorded.

    Args:
        index: device index in ``list_devices()`` order (``--main-gpu``).
    """

    def __init__(self, index: int = 0):
        inst = _Instance.get()
        if not inst.devices:
            raise VulkanUnavailable("no Vulkan device found (the loader lists none)")
        if not 0 <= index < len(inst.devices):
            raise VulkanUnavailable(f"--main-gpu {index} out of range: {len(inst.devices)} Vulkan device(s)")
        vk = self.vk = inst.vk
        ffi = self.ffi = vk.ffi
        lib = self.lib = vk.lib
        self.info = inst.devices[index]
        pd = self.physical = self.info.handle
        props = ffi.new("VkPhysicalDeviceProperties*")
        lib.vkGetPhysicalDeviceProperties(pd, props)
        lim = props.limits
        self.max_range = int(lim.maxStorageBufferRange)
        self.align = max(256, int(lim.minStorageBufferOffsetAlignment))
        self.max_groups = [int(lim.maxComputeWorkGroupCount[i]) for i in range(3)]
        self.max_shared = int(lim.maxComputeSharedMemorySize)
        mp = ffi.new("VkPhysicalDeviceMemoryProperties*")
        lib.vkGetPhysicalDeviceMemoryProperties(pd, mp)
        self._mem_types = [int(mp.memoryTypes[i].propertyFlags) for i in range(mp.memoryTypeCount)]
        self.max_alloc = 1 << 30  # Vulkan 1.1's guaranteed minimum, unless the driver says more
        self.subgroup_size = 0
        if pr_ver(props.apiVersion) >= (1, 1):
            m3 = ffi.new("VkPhysicalDeviceMaintenance3Properties*", {
                "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES})
            sg = ffi.new("VkPhysicalDeviceSubgroupProperties*", {
                "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES, "pNext": m3})
            p2 = ffi.new("VkPhysicalDeviceProperties2*", {
                "sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, "pNext": sg})
            lib.vkGetPhysicalDeviceProperties2(pd, p2)
            self.max_alloc = max(self.max_alloc, int(m3.maxMemoryAllocationSize))
            self.subgroup_size = int(sg.subgroupSize)
        # queue family with compute
        n = ffi.new("uint32_t*")
        lib.vkGetPhysicalDeviceQueueFamilyProperties(pd, n, ffi.NULL)
        qf = ffi.new("VkQueueFamilyProperties[]", n[0])
        lib.vkGetPhysicalDeviceQueueFamilyProperties(pd, n, qf)
        fam = next((i for i in range(n[0]) if qf[i].queueFlags & vk.VK_QUEUE_COMPUTE_BIT), None)
        if fam is None:
            raise VulkanUnavailable(f"Vulkan device {self.info.name!r} has no compute queue")
        prio = ffi.new("float[]", [1.0])
        qinfo = ffi.new("VkDeviceQueueCreateInfo*", {"sType": vk.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO,
                                                     "queueFamilyIndex": fam, "queueCount": 1,
                                                     "pQueuePriorities": prio})
        dinfo = ffi.new("VkDeviceCreateInfo*", {"sType": vk.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO,
                                                "queueCreateInfoCount": 1, "pQueueCreateInfos": qinfo})
        dev = ffi.new("VkDevice*")
        res = lib.vkCreateDevice(pd, dinfo, ffi.NULL, dev)
        if res != 0:
            raise VulkanUnavailable(f"cannot open Vulkan device {self.info.name!r}: {_RESULTS.get(res, res)}")
        self.device = dev[0]
        q = ffi.new("VkQueue*")
        lib.vkGetDeviceQueue(self.device, fam, 0, q)
        self.queue = q[0]
        cp = ffi.new("VkCommandPoolCreateInfo*", {"sType": vk.VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO,
                                                  "flags": vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT,
                                                  "queueFamilyIndex": fam})
        pool = ffi.new("VkCommandPool*")
        _check(lib.vkCreateCommandPool(self.device, cp, ffi.NULL, pool), "vkCreateCommandPool")
        self.cmd_pool = pool[0]
        ca = ffi.new("VkCommandBufferAllocateInfo*", {"sType": vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO,
                                                      "commandPool": self.cmd_pool, "commandBufferCount": 1,
                                                      "level": vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY})
        cb = ffi.new("VkCommandBuffer[1]")
        _check(lib.vkAllocateCommandBuffers(self.device, ca, cb), "vkAllocateCommandBuffers")
        self._cmd_arr = cb
        self.cmd = cb[0]
        ea = ffi.new("VkCommandBuffer[1]")
        _check(lib.vkAllocateCommandBuffers(self.device, ca, ea), "vkAllocateCommandBuffers")
        self._epi = ea[0]
        self._submit_cmds = ffi.new("VkCommandBuffer[3]")
        self._graph_begin = ffi.new("VkCommandBufferBeginInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO})
        self._target: CommandGraph | None = None
        fi = ffi.new("VkFenceCreateInfo*", {"sType": vk.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO})
        fence = ffi.new("VkFence[1]")
        _check(lib.vkCreateFence(self.device, fi, ffi.NULL, fence), "vkCreateFence")
        self._fence = fence
        self._begin_info = ffi.new("VkCommandBufferBeginInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
            "flags": vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT})
        self._submit = ffi.new("VkSubmitInfo*", {"sType": vk.VK_STRUCTURE_TYPE_SUBMIT_INFO,
                                                 "commandBufferCount": 1, "pCommandBuffers": cb})
        stages = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT
        self._stages = stages
        self._barrier = ffi.new("VkMemoryBarrier*", {
            "sType": vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
            "srcAccessMask": vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT,
            "dstAccessMask": vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT
            | vk.VK_ACCESS_TRANSFER_READ_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT})
        self._host_barrier = ffi.new("VkMemoryBarrier*", {
            "sType": vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER, "srcAccessMask": vk.VK_ACCESS_TRANSFER_WRITE_BIT,
            "dstAccessMask": vk.VK_ACCESS_HOST_READ_BIT})
        self._region = ffi.new("VkBufferCopy*")
        self._lock = threading.RLock()
        self._pending: list = []  # (block, offset, size) released by Alloc.__del__, not yet merged
        self._recording = False
        self._n_cmds = 0
        self._reads: list = []
        self._writes: list = []
        self.blocks: list[Block] = []
        self.staging = Block(self, STAGING_BYTES, host=True)
        self._staging_head = 0
        self.readback = Block(self, READBACK_BYTES, host=True)
        self._set_layouts: dict = {}
        self._pipe_layouts: dict = {}
        self._pipelines: dict = {}
        self._modules: list = []
        self._sets: dict = {}
        self._new_desc_pool()
        self.n_submits = 0
        self.n_dispatches = 0
        self.closed = False

    # -- memory -------------------------------------------------------------------------
    def memory_type(self, bits: int, required: int, preferred: int) -> int:
        """Index of a memory type allowed by ``bits`` with the ``required`` flags (``preferred`` ones if any)."""
        ok = [i for i, f in enumerate(self._mem_types) if bits & (1 << i) and f & required == required]
        if not ok:
            raise VulkanError(f"no Vulkan memory type with flags {required:#x}")
        best = [i for i in ok if self._mem_types[i] & preferred == preferred]
        return (best or ok)[0]

    def alloc(self, nbytes: int) -> Alloc:
        """``nbytes`` (rounded up to ``align``) of device memory. Raises ``VulkanError`` when out of memory."""
        size = max(self.align, -(-int(nbytes) // self.align) * self.align)
        with self._lock:
            self._drain_frees()
            best = None
            for b in self.blocks:
                for j, (o, s) in enumerate(b.free):
                    if s >= size and (best is None or s < best[3]):
                        best = (b, j, o, s)
                        if s == size:
                            break
            if best is None:
                if size > self.max_alloc:
                    raise VulkanError(f"a {size / 2**20:.0f} MiB device buffer exceeds the "
                                      f"{self.max_alloc / 2**20:.0f} MiB allocation limit")
                b = Block(self, max(size, BLOCK_BYTES) if size <= BLOCK_BYTES else size)
                self.blocks.append(b)
                best = (b, 0, 0, b.size)
            b, j, o, s = best
            if s == size:
                del b.free[j]
            else:
                b.free[j] = (o + size, s - size)
            a = Alloc(self, b, o, size)
            if self._target is not None:
                self._target.retained.append(a)
            return a

    def _free(self, a: Alloc) -> None:
        """Queue ``a``'s range for release. Called from ``Alloc.__del__``, which may run
        at any allocation (cyclic GC), even inside ``alloc``: so only an atomic append
        here; the free lists change in ``_drain_frees``, at the next ``alloc``."""
        if not self.closed:
            self._pending.append((a.block, a.offset, a.size))

    def _drain_frees(self) -> None:
        pend = self._pending
        while pend:
            block, o, s = pend.pop()
            fl = block.free
            i = bisect.bisect_left(fl, (o, 0))
            if i < len(fl) and fl[i][0] == o + s:  # merge with the next range
                s += fl[i][1]
                del fl[i]
            if i > 0 and fl[i - 1][0] + fl[i - 1][1] == o:  # and the previous
                o, s = fl[i - 1][0], fl[i - 1][1] + s
                del fl[i - 1]
                i -= 1
            fl.insert(i, (o, s))

    def bytes_in_use(self) -> int:
        """Device bytes allocated to live tensors."""
        with self._lock:
            self._drain_frees()
            return sum(b.size - sum(s for _, s in b.free) for b in self.blocks)

    # -- recording ----------------------------------------------------------------------
    def _cmdbuf(self):
        if self._target is not None:
            return self._target.cmd
        if not self._recording:
            _check(self.lib.vkBeginCommandBuffer(self.cmd, self._begin_info), "vkBeginCommandBuffer")
            self._recording = True
        return self.cmd

    def _hazard(self, reads: list, writes: list) -> None:
        """Insert a barrier when this command conflicts with one since the last barrier.
        reads / writes: (block id, lo, hi) byte ranges."""
        g = self._target
        h_reads, h_writes = (g.reads, g.writes) if g is not None else (self._reads, self._writes)
        conflict = False
        for (b, lo, hi) in reads + writes:
            for (b2, lo2, hi2) in h_writes:
                if b == b2 and lo < hi2 and lo2 < hi:
                    conflict = True
                    break
            if conflict:
                break
        if not conflict:
            for (b, lo, hi) in writes:
                for (b2, lo2, hi2) in h_reads:
                    if b == b2 and lo < hi2 and lo2 < hi:
                        conflict = True
                        break
                if conflict:
                    break
        if conflict:
            self.lib.vkCmdPipelineBarrier(self._cmdbuf(), self._stages, self._stages, 0, 1, self._barrier,
                                          0, self.ffi.NULL, 0, self.ffi.NULL)
            h_reads.clear()
            h_writes.clear()
        h_reads += reads
        h_writes += writes

    def _layout(self, n: int):
        """(descriptor set layout, pipeline layout) for ``n`` storage-buffer bindings."""
        hit = self._pipe_layouts.get(n)
        if hit is not None:
            return hit
        vk, ffi, lib = self.vk, self.ffi, self.lib
        binds = ffi.new("VkDescriptorSetLayoutBinding[]", n)
        for i in range(n):
            binds[i].binding = i
            binds[i].descriptorType = vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
            binds[i].descriptorCount = 1
            binds[i].stageFlags = vk.VK_SHADER_STAGE_COMPUTE_BIT
        info = ffi.new("VkDescriptorSetLayoutCreateInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO, "bindingCount": n, "pBindings": binds})
        dsl = ffi.new("VkDescriptorSetLayout[1]")
        _check(lib.vkCreateDescriptorSetLayout(self.device, info, ffi.NULL, dsl), "vkCreateDescriptorSetLayout")
        pcr = ffi.new("VkPushConstantRange*", {"stageFlags": vk.VK_SHADER_STAGE_COMPUTE_BIT, "offset": 0,
                                               "size": PUSH_BYTES})
        pinfo = ffi.new("VkPipelineLayoutCreateInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO, "setLayoutCount": 1, "pSetLayouts": dsl,
            "pushConstantRangeCount": 1, "pPushConstantRanges": pcr})
        pl = ffi.new("VkPipelineLayout*")
        _check(lib.vkCreatePipelineLayout(self.device, pinfo, ffi.NULL, pl), "vkCreatePipelineLayout")
        hit = self._pipe_layouts[n] = (dsl, pl[0])
        return hit

    def pipeline(self, name: str, n_bind: int, spec: tuple[int, ...] = ()):
        """(pipeline, pipeline layout) of SPIR-V module ``name`` with uint specialization
        constants ``spec`` (constant_id 0, 1, ...), created on first use."""
        key = (name, spec)
        hit = self._pipelines.get(key)
        if hit is not None:
            return hit
        from opencoti.vk_shaders import load_spv

        vk, ffi, lib = self.vk, self.ffi, self.lib
        spv = load_spv(name)
        code = ffi.new("char[]", spv)
        minfo = ffi.new("VkShaderModuleCreateInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO, "codeSize": len(spv),
            "pCode": ffi.cast("uint32_t*", code)})
        mod = ffi.new("VkShaderModule*")
        _check(lib.vkCreateShaderModule(self.device, minfo, ffi.NULL, mod), f"vkCreateShaderModule({name})")
        self._modules.append(mod[0])
        _, layout = self._layout(n_bind)
        entry = ffi.new("char[]", b"main")
        stage = {"sType": vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO,
                 "stage": vk.VK_SHADER_STAGE_COMPUTE_BIT, "module": mod[0], "pName": entry}
        if spec:
            entries = ffi.new("VkSpecializationMapEntry[]", len(spec))
            for i in range(len(spec)):
                entries[i].constantID, entries[i].offset, entries[i].size = i, 4 * i, 4
            data = ffi.new("uint32_t[]", list(spec))
            sinfo = ffi.new("VkSpecializationInfo*", {"mapEntryCount": len(spec), "pMapEntries": entries,
                                                      "dataSize": 4 * len(spec), "pData": data})
            stage["pSpecializationInfo"] = sinfo
        cinfo = ffi.new("VkComputePipelineCreateInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO, "stage": stage, "layout": layout})
        pipe = ffi.new("VkPipeline*")
        _check(lib.vkCreateComputePipelines(self.device, ffi.NULL, 1, cinfo, ffi.NULL, pipe),
               f"vkCreateComputePipelines({name})")
        hit = self._pipelines[key] = (pipe[0], layout)
        return hit

    def _make_desc_pool(self, n_sets: int):
        vk, ffi = self.vk, self.ffi
        size = ffi.new("VkDescriptorPoolSize*", {"type": vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                                 "descriptorCount": n_sets * 8})
        info = ffi.new("VkDescriptorPoolCreateInfo*", {"sType": vk.VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO,
                                                       "maxSets": n_sets, "poolSizeCount": 1,
                                                       "pPoolSizes": size})
        pool = ffi.new("VkDescriptorPool*")
        _check(self.lib.vkCreateDescriptorPool(self.device, info, ffi.NULL, pool), "vkCreateDescriptorPool")
        return pool[0]

    def _new_desc_pool(self) -> None:
        self._desc_pool = self._make_desc_pool(MAX_SETS)

    def _descriptor_set(self, binds: list):
        """A descriptor set (as a 1-element array) for ``binds`` [(Alloc, offset, range)],
        cached; while a graph is recorded, from the graph's own pool."""
        g = self._target
        cache = g.sets if g is not None else self._sets
        key = tuple((a.block.id, a.offset + o, r) for a, o, r in binds)
        ds = cache.get(key)
        if ds is not None:
            return ds
        if g is not None and len(cache) >= g.max_sets:  # drivers need not enforce maxSets themselves
            raise GraphTooLarge(f"a graph needs more than {g.max_sets} descriptor sets")
        vk, ffi, lib = self.vk, self.ffi, self.lib
        n = len(binds)
        dsl, _ = self._layout(n)
        info = ffi.new("VkDescriptorSetAllocateInfo*", {
            "sType": vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO,
            "descriptorPool": g.pool if g is not None else self._desc_pool,
            "descriptorSetCount": 1, "pSetLayouts": dsl})
        ds = ffi.new("VkDescriptorSet[1]")
        res = lib.vkAllocateDescriptorSets(self.device, info, ds)
        if g is not None and res in _POOL_FULL:
            raise GraphTooLarge(f"a graph needs more than {g.max_sets} descriptor sets")
        if g is None and (res in _POOL_FULL or len(self._sets) >= MAX_SETS):
            # sets of pending commands must stay valid: finish them, then start the pool over
            self.flush()
            _check(lib.vkResetDescriptorPool(self.device, self._desc_pool, 0), "vkResetDescriptorPool")
            self._sets.clear()
            res = lib.vkAllocateDescriptorSets(self.device, info, ds)
        _check(res, "vkAllocateDescriptorSets")
        bi = ffi.new("VkDescriptorBufferInfo[]", n)
        wr = ffi.new("VkWriteDescriptorSet[]", n)
        for i, (a, o, r) in enumerate(binds):
            bi[i].buffer = a.block.buffer
            bi[i].offset = a.offset + o
            bi[i].range = r
            wr[i].sType = vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET
            wr[i].dstSet = ds[0]
            wr[i].dstBinding = i
            wr[i].descriptorCount = 1
            wr[i].descriptorType = vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
            wr[i].pBufferInfo = bi + i
        lib.vkUpdateDescriptorSets(self.device, n, wr, 0, ffi.NULL)
        cache[key] = ds
        return ds

    def dispatch(self, name: str, binds: list, push: bytes, groups: tuple[int, int, int],
                 writes: tuple[int, ...], spec: tuple[int, ...] = ()) -> None:
        """Record one compute dispatch.

        binds: ``[(Alloc, byte offset, byte range)]`` for bindings 0..n-1 (offset a
        multiple of ``align``, range <= ``max_range``); push: packed push constants
        (<= 128 bytes); groups: workgroup counts; writes: the binding indices the
        shader writes (for hazard tracking); spec: specialization constants.
        """
        if groups[0] <= 0 or groups[1] <= 0 or groups[2] <= 0:
            return
        lib, ffi = self.lib, self.ffi
        for a, o, r in binds:
            if r > self.max_range:
                raise VulkanError(f"{name}: a {r / 2**20:.0f} MiB binding exceeds the device's "
                                  f"maxStorageBufferRange ({self.max_range / 2**20:.0f} MiB)")
            if (a.offset + o) % self.align or o + r > a.size:
                raise VulkanError(f"{name}: bad binding window offset {o} range {r} of a {a.size}-byte buffer")
        pipe, layout = self.pipeline(name, len(binds), spec)
        ds = self._descriptor_set(binds)
        reads, wr = [], []
        for i, (a, o, r) in enumerate(binds):
            rng = (a.block.id, a.offset + o, a.offset + o + r)
            (wr if i in writes else reads).append(rng)
        self._hazard(reads, wr)
        cmd = self._cmdbuf()
        lib.vkCmdBindPipeline(cmd, 1, pipe)  # VK_PIPELINE_BIND_POINT_COMPUTE
        lib.vkCmdBindDescriptorSets(cmd, 1, layout, 0, 1, ds, 0, ffi.NULL)
        if push:
            lib.vkCmdPushConstants(cmd, layout, self.vk.VK_SHADER_STAGE_COMPUTE_BIT, 0, len(push),
                                   ffi.from_buffer(push))
        lib.vkCmdDispatch(cmd, int(groups[0]), int(groups[1]), int(groups[2]))
        self._n_cmds += 1
        self.n_dispatches += 1

    def groups_1d(self, n: int) -> tuple[int, int, int]:
        """Workgroup counts for ``n`` workgroups, folded into (x, y) past the x limit (see wg_index())."""
        mx = min(65535, self.max_groups[0])
        if n <= mx:
            return (n, 1, 1)
        return (mx, -(-n // mx), 1)

    # -- transfers ----------------------------------------------------------------------
    def upload(self, a: Alloc, offset: int, data) -> None:
        """Record a write of ``data`` (bytes-like or array) to ``a`` at byte ``offset``."""
        buf = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        n = buf.size
        if n == 0:
            return
        if n % 4:
            buf = np.concatenate([buf, np.zeros(4 - n % 4, np.uint8)])
            n = buf.size
        if offset % 4 or offset + n > a.size:
            raise VulkanError(f"upload of {n} bytes at {offset} into a {a.size}-byte buffer")
        lo = a.offset + offset
        if n <= UPDATE_MAX:
            self._hazard([], [(a.block.id, lo, lo + n)])
            self.lib.vkCmdUpdateBuffer(self._cmdbuf(), a.block.buffer, lo, n, self.ffi.from_buffer(buf))
            self._n_cmds += 1
            return
        done = 0
        while done < n:
            room = STAGING_BYTES - self._staging_head
            if room < min(n - done, 1 << 20):
                self.flush()
                room = STAGING_BYTES
            k = min(n - done, room)
            h = self._staging_head
            self.staging.mapped[h:h + k] = buf[done:done + k]
            self._staging_head = -(-(h + k) // 256) * 256
            self._hazard([], [(a.block.id, lo + done, lo + done + k)])
            r = self._region
            r.srcOffset, r.dstOffset, r.size = h, lo + done, k
            self.lib.vkCmdCopyBuffer(self._cmdbuf(), self.staging.buffer, a.block.buffer, 1, r)
            self._n_cmds += 1
            done += k

    def upload_prologue(self, a: Alloc, offset: int, data) -> None:
        """Record an upload into the main command buffer even while a graph is recorded:
        a graph's per-step inputs, written before the graph runs (it begins with a barrier)."""
        g, self._target = self._target, None
        try:
            self.upload(a, offset, data)
        finally:
            self._target = g

    # -- graphs (recorded command buffers, replayed per decode step) ----------------------
    def begin_capture(self) -> CommandGraph:
        """Start recording dispatches into a new ``CommandGraph`` (flushes pending work)."""
        self.flush()
        g = CommandGraph(self)
        _check(self.lib.vkBeginCommandBuffer(g.cmd, self._graph_begin), "vkBeginCommandBuffer")
        self.lib.vkCmdPipelineBarrier(g.cmd, self._stages, self._stages, 0, 1, self._barrier,
                                      0, self.ffi.NULL, 0, self.ffi.NULL)
        self._target = g
        return g

    def end_capture(self) -> CommandGraph:
        g, self._target = self._target, None
        _check(self.lib.vkEndCommandBuffer(g.cmd), "vkEndCommandBuffer")
        return g

    def abort_capture(self) -> None:
        """Drop the graph being recorded (its per-step input uploads still run first)."""
        g, self._target = self._target, None
        if g is not None:
            self.lib.vkEndCommandBuffer(g.cmd)
            self.flush()
            g.release()

    def run_graph(self, g: CommandGraph, a: Alloc, offset: int, nbytes: int) -> np.ndarray:
        """Submit the main command buffer (the step's input uploads), graph ``g`` and a
        copy of ``nbytes`` at ``offset`` of ``a`` back to the host, in one submission;
        wait; return those bytes (uint8)."""
        if nbytes > READBACK_BYTES:
            raise VulkanError(f"graph output of {nbytes} bytes exceeds the readback buffer")
        lib, ffi = self.lib, self.ffi
        with self._lock:
            cmds, n = self._submit_cmds, 0
            if self._recording:
                _check(lib.vkEndCommandBuffer(self.cmd), "vkEndCommandBuffer")
                self._recording = False
                cmds[n] = self.cmd
                n += 1
            cmds[n] = g.cmd
            n += 1
            epi = self._epi
            _check(lib.vkBeginCommandBuffer(epi, self._begin_info), "vkBeginCommandBuffer")
            lib.vkCmdPipelineBarrier(epi, self._stages, self._stages, 0, 1, self._barrier, 0, ffi.NULL, 0, ffi.NULL)
            r = self._region
            r.srcOffset, r.dstOffset, r.size = a.offset + offset, 0, -(-nbytes // 4) * 4
            lib.vkCmdCopyBuffer(epi, a.block.buffer, self.readback.buffer, 1, r)
            lib.vkCmdPipelineBarrier(epi, self.vk.VK_PIPELINE_STAGE_TRANSFER_BIT, self.vk.VK_PIPELINE_STAGE_HOST_BIT,
                                     0, 1, self._host_barrier, 0, ffi.NULL, 0, ffi.NULL)
            _check(lib.vkEndCommandBuffer(epi), "vkEndCommandBuffer")
            cmds[n] = epi
            n += 1
            sub = ffi.new("VkSubmitInfo*", {"sType": self.vk.VK_STRUCTURE_TYPE_SUBMIT_INFO,
                                            "commandBufferCount": n, "pCommandBuffers": cmds})
            _check(lib.vkQueueSubmit(self.queue, 1, sub, self._fence[0]), "vkQueueSubmit")
            _check(lib.vkWaitForFences(self.device, 1, self._fence, 1, 0xFFFFFFFFFFFFFFFF), "vkWaitForFences")
            _check(lib.vkResetFences(self.device, 1, self._fence), "vkResetFences")
            _check(lib.vkResetCommandBuffer(self.cmd, 0), "vkResetCommandBuffer")
            _check(lib.vkResetCommandBuffer(epi, 0), "vkResetCommandBuffer")
            self._staging_head = 0
            self._reads.clear()
            self._writes.clear()
            self._n_cmds = 0
            self.n_submits += 1
            return self.readback.mapped[:nbytes].copy()

    def fill(self, a: Alloc, offset: int, nbytes: int, value: int = 0) -> None:
        """Record filling ``nbytes`` (a multiple of 4) at ``offset`` with the 32-bit ``value``."""
        lo = a.offset + offset
        self._hazard([], [(a.block.id, lo, lo + nbytes)])
        self.lib.vkCmdFillBuffer(self._cmdbuf(), a.block.buffer, lo, nbytes, value)
        self._n_cmds += 1

    def download(self, a: Alloc, offset: int, nbytes: int) -> np.ndarray:
        """``nbytes`` at ``offset`` of ``a`` as a new uint8 array (flushes: waits for all recorded work)."""
        if self._target is not None:
            raise VulkanError("device memory cannot be read while a graph is being recorded")
        out = np.empty(nbytes, dtype=np.uint8)
        done = 0
        while done < nbytes:
            k = min(nbytes - done, READBACK_BYTES)
            lo = a.offset + offset + done
            self._hazard([(a.block.id, lo, lo + k)], [(self.readback.id, 0, k)])
            r = self._region
            r.srcOffset, r.dstOffset, r.size = lo, 0, -(-k // 4) * 4
            cmd = self._cmdbuf()
            self.lib.vkCmdCopyBuffer(cmd, a.block.buffer, self.readback.buffer, 1, r)
            self.lib.vkCmdPipelineBarrier(cmd, self.vk.VK_PIPELINE_STAGE_TRANSFER_BIT,
                                          self.vk.VK_PIPELINE_STAGE_HOST_BIT, 0, 1, self._host_barrier,
                                          0, self.ffi.NULL, 0, self.ffi.NULL)
            self._n_cmds += 1
            self.flush()
            out[done:done + k] = self.readback.mapped[:k]
            done += k
        return out

    def copy(self, src: Alloc, src_off: int, dst: Alloc, dst_off: int, nbytes: int) -> None:
        """Record a device-to-device copy."""
        s, d = src.offset + src_off, dst.offset + dst_off
        self._hazard([(src.block.id, s, s + nbytes)], [(dst.block.id, d, d + nbytes)])
        r = self._region
        r.srcOffset, r.dstOffset, r.size = s, d, nbytes
        self.lib.vkCmdCopyBuffer(self._cmdbuf(), src.block.buffer, dst.block.buffer, 1, r)
        self._n_cmds += 1

    def flush(self) -> None:
        """Submit what was recorded and wait for it (no-op when nothing was)."""
        with self._lock:
            if not self._recording:
                return
            lib = self.lib
            _check(lib.vkEndCommandBuffer(self.cmd), "vkEndCommandBuffer")
            self._recording = False
            _check(lib.vkQueueSubmit(self.queue, 1, self._submit, self._fence[0]), "vkQueueSubmit")
            res = lib.vkWaitForFences(self.device, 1, self._fence, 1, 0xFFFFFFFFFFFFFFFF)
            _check(res, "vkWaitForFences")
            _check(lib.vkResetFences(self.device, 1, self._fence), "vkResetFences")
            _check(lib.vkResetCommandBuffer(self.cmd, 0), "vkResetCommandBuffer")
            self._staging_head = 0
            self._reads.clear()
            self._writes.clear()
            self._n_cmds = 0
            self.n_submits += 1

    def close(self) -> None:
        """Wait for the device and release every Vulkan object (tensors become invalid)."""
        if self.closed:
            return
        try:
            self.flush()
        finally:
            lib, ffi, dev = self.lib, self.ffi, self.device
            lib.vkDeviceWaitIdle(dev)
            self.closed = True
            for p, _ in self._pipelines.values():
                lib.vkDestroyPipeline(dev, p, ffi.NULL)
            for m in self._modules:
                lib.vkDestroyShaderModule(dev, m, ffi.NULL)
            for dsl, pl in self._pipe_layouts.values():
                lib.vkDestroyPipelineLayout(dev, pl, ffi.NULL)
                lib.vkDestroyDescriptorSetLayout(dev, dsl[0], ffi.NULL)
            lib.vkDestroyDescriptorPool(dev, self._desc_pool, ffi.NULL)
            for b in self.blocks + [self.staging, self.readback]:
                b.destroy(self)
            lib.vkDestroyFence(dev, self._fence[0], ffi.NULL)
            lib.vkDestroyCommandPool(dev, self.cmd_pool, ffi.NULL)
            lib.vkDestroyDevice(dev, ffi.NULL)


def describe(info: DeviceInfo) -> str:
    """``"NVIDIA H200 (discrete GPU, Vulkan 1.4.312)"``."""
    return f"{info.name} ({info.type_name}, Vulkan {info.api_version})"


if __name__ == "__main__":  # python -m opencoti.engine.backend.vk_runtime: list devices
    try:
        for d in list_devices():
            print(f"{d.index}: {describe(d)}")
    except VulkanUnavailable as e:
        print(f"vulkan: {e}", file=sys.stderr)
        sys.exit(1)
