"""KV page copies between the device pool and the pinned host pool on a side CUDA stream, started at
the layer boundaries of the jitted forward.

Why not XLA: REFERENCE.md records that on the H200 none of the pure-XLA placements of the copy
(per-layer host DUS in the scan, pipelined host offloading, compute_on a second stream) overlapped
the forward, and JAX's async D2H paths ran at ~2 GB/s, while a cudaMemcpyAsync on another stream into
pinned memory hid the whole transfer. So the forward calls `layer_boundary` between layers: a
legacy XLA custom call (a ctypes callback: no compiled extension to build) that receives XLA's
compute stream and the pool's device buffers. At boundary c of a step it
  - (c = 0) enqueues the step's host->device loads, per layer, on the side stream;
  - makes the compute stream wait for layer c's loads (so the layer's attention sees its pages);
  - records an event on the compute stream after layer c-1 and enqueues, behind it on the side
    stream, the device->host copies of the pages layer c-1 wrote, then an event that acknowledges
    them.
The pool operands are aliased to the results, so the call moves nothing and orders nothing beyond
"after the previous layer's writes, before the next layer". Copies outside a forward (pages that
already existed, the draft layer, finish-time write-backs) go on the same side stream after the
host has seen the step end. One side stream per device: every copy of a device is FIFO, so host
and device pages can be reused without further ordering.

On GPU it loads libcudart with ctypes. On the CPU backend the same hook and protocol run over
`HostRuntime` (synchronous memmoves, events always complete): not a fast path, the way the CPU test
suite exercises staging, hooks, acknowledgements and commits exactly as the GPU runs them."""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import dataclasses
import glob
import importlib.util
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

TARGET = "cpkv_layer_boundary"
H2D, D2H = 1, 2                     # cudaMemcpyKind
_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                             ctypes.c_size_t, ctypes.c_void_p)


def _find_cudart() -> str | None:
    """libcudart from the CUDA wheels jax depends on, else the system's."""
    dirs = []
    for pkg in ("nvidia.cuda_runtime", "nvidia.cu13", "nvidia.cu12"):
        try:
            spec = importlib.util.find_spec(pkg)
        except ModuleNotFoundError:
            spec = None
        if spec is not None:
            dirs += [os.path.join(p, "lib") for p in spec.submodule_search_locations or ()]
    for d in dirs:
        hits = sorted(glob.glob(os.path.join(d, "libcudart.so*")))
        if hits:
            return hits[-1]
    return ctypes.util.find_library("cudart")


class HostRuntime:
    """cudart's stand-in on the CPU backend: a copy is a memmove done when issued (the hook runs in
    the forward's order, so that is the layer boundary), every event is complete."""

    path = "memmove (CPU backend)"
    asynchronous = False             # a copy is complete when issued: the source may move afterwards

    def device_key(self, device, index: int) -> int:
        return index

    def call_device(self, buffers, n_leaves: int) -> int:
        """The device-index operand the hook passes after the pool and the hidden state (host memory
        here): the device's position in the mesh."""
        return ctypes.c_int32.from_address(buffers[n_leaves + 1]).value

    def new_stream(self, device: int) -> int:
        return 0

    def new_event(self, device: int) -> int:
        return 0

    def done(self, event: int) -> bool:
        return True

    def memcpy(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def record(self, event: int, stream: int) -> None:
        pass

    def wait(self, stream: int, event: int) -> None:
        pass

    def sync(self, stream: int) -> None:
        pass


class CudaRuntime:
    """The few cudart calls the copies need; every call checked."""

    asynchronous = True              # copies run after the hook returns: their source must stay put

    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)
        self.lib.cudaGetErrorString.restype = ctypes.c_char_p
        self.path = path

    def device_key(self, device, index: int) -> int:
        return device.local_hardware_id

    def call_device(self, buffers, n_leaves: int) -> int:
        attrs = (ctypes.c_int * 64)()    # cudaPointerAttributes: type, device, ... (+ reserved in CUDA 13)
        self("cudaPointerGetAttributes", attrs, ctypes.c_void_p(buffers[0]))
        return attrs[1]

    def __call__(self, name: str, *args) -> None:
        err = getattr(self.lib, name)(*args)
        if err:
            raise RuntimeError(f"{name} failed: {err} {self.lib.cudaGetErrorString(err)!r}")

    def new_stream(self, device: int) -> int:
        self("cudaSetDevice", device)
        s = ctypes.c_void_p()
        self("cudaStreamCreateWithFlags", ctypes.byref(s), 1)       # non-blocking
        return s.value

    def new_event(self, device: int) -> int:
        self("cudaSetDevice", device)
        e = ctypes.c_void_p()
        self("cudaEventCreateWithFlags", ctypes.byref(e), 2)        # disable timing
        return e.value

    def done(self, event: int) -> bool:
        err = self.lib.cudaEventQuery(ctypes.c_void_p(event))
        if err in (0, 600):                                            # success / not ready
            return err == 0
        raise RuntimeError(f"cudaEventQuery failed: {err}")

    def memcpy(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        self("cudaMemcpyAsync", ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes), kind,
             ctypes.c_void_p(stream))

    def record(self, event: int, stream: int) -> None:
        self("cudaEventRecord", ctypes.c_void_p(event), ctypes.c_void_p(stream))

    def wait(self, stream: int, event: int) -> None:
        self("cudaStreamWaitEvent", ctypes.c_void_p(stream), ctypes.c_void_p(event), 0)

    def sync(self, stream: int) -> None:
        self("cudaStreamSynchronize", ctypes.c_void_p(stream))


@dataclasses.dataclass(frozen=True)
class Copy:
    """One contiguous block: `nbytes` at byte `offset` of pool leaf `leaf` <-> host address `host`."""
    leaf: int
    offset: int
    host: int
    nbytes: int


@dataclasses.dataclass
class StepCopies:
    """One forward's copies on one device: per layer, loads (host->device, waited for at the layer's
    start) and backups (device->host, started at the layer's end). Filled in by the callback: the
    pool addresses it saw and the event acknowledging each layer's backups."""
    boundaries: int                  # hooks per forward: layers + 1
    device: int                      # the runtime's device key (CUDA ordinal; position in the mesh on CPU)
    loads: dict[int, list[Copy]] = dataclasses.field(default_factory=dict)
    backups: dict[int, list[Copy]] = dataclasses.field(default_factory=dict)
    fail_at_layer: int | None = None
    calls: int = 0
    pool_addresses: set = dataclasses.field(default_factory=set)
    backup_events: dict[int, int] = dataclasses.field(default_factory=dict)
    load_events: dict[int, int] = dataclasses.field(default_factory=dict)
    events: list = dataclasses.field(default_factory=list)   # every event this forward recorded
    failed: list = dataclasses.field(default_factory=list)
    users: int = 0                   # open reservations waiting on these copies

    def layer_done(self, layer: int, rt: CudaRuntime) -> bool | None:
        """True once layer's backups completed, None if they failed (or never started)."""
        if self.failed or layer == self.fail_at_layer:
            return None
        ev = self.backup_events.get(layer)
        return ev is not None and rt.done(ev)


class SideStreamCopier:
    """Per device: a side stream, an event pool and the FIFO of StepCopies the next forwards consume
    (every dispatch of a hooked forward pushes exactly one, empty or not)."""

    def __init__(self, rt: CudaRuntime):
        self.rt = rt
        self.queues: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self.streams: dict[int, int] = {}
        self.free_events: dict[int, list[int]] = collections.defaultdict(list)   # per device
        self.lock = threading.Lock()
        self.errors: list[str] = []
        self.live: list[StepCopies] = []      # pushed forwards whose events are not recycled yet
        self.retiring: list[int] = []         # events of finished reservations, recycled once done
        self._callback = _CALLBACK(self._boundary)      # kept alive: XLA holds the raw pointer

    # ---- streams and events ----------------------------------------------------------------------
    def stream(self, device: int) -> int:
        with self.lock:
            if device not in self.streams:
                self.streams[device] = self.rt.new_stream(device)
            return self.streams[device]

    def event(self, device: int) -> tuple[int, int]:
        """(device, event): an event lives on its device and is recycled into that device's pool."""
        with self.lock:
            free = self.free_events[device]
            return device, (free.pop() if free else self.rt.new_event(device))

    def recycle(self, events) -> None:
        with self.lock:
            for device, ev in events:
                self.free_events[device].append(ev)

    # ---- inside the forward ----------------------------------------------------------------------
    def push(self, copies: StepCopies) -> None:
        with self.lock:
            self.queues[copies.device].append(copies)
            self.live.append(copies)

    def retire_events(self, events) -> None:
        self.retiring.extend(events)

    def reap(self) -> None:
        """Recycle the events of forwards nobody waits on and of retired reservations, once complete."""
        keep = []
        for step in self.live:
            if step.calls == step.boundaries and step.users <= 0 and all(self.rt.done(e) for _, e in step.events):
                self.recycle(step.events)
            else:
                keep.append(step)
        self.live = keep
        done = [e for e in self.retiring if self.rt.done(e[1])]
        self.retiring = [e for e in self.retiring if e not in set(done)]
        self.recycle(done)

    def _boundary(self, stream, buffers, opaque, opaque_len, status) -> None:
        step = None
        try:
            n_leaves = int(ctypes.string_at(opaque, opaque_len))
            device = self.rt.call_device(buffers, n_leaves)
            with self.lock:
                queue = self.queues.get(device)
                if not queue:
                    raise RuntimeError(f"a hooked forward ran on device {device} with no copies pushed")
                step = queue[0]
                c = step.calls
                step.calls += 1
                if step.calls == step.boundaries:
                    queue.popleft()
            leaves = [buffers[i] for i in range(n_leaves)]
            step.pool_addresses.add(tuple(leaves))
            side = self.stream(step.device)
            if c == 0 and step.loads:
                self.rt.wait(side, self._mark(stream, step.device, step))
                for layer in sorted(step.loads):
                    for cp in step.loads[layer]:
                        self.rt.memcpy(leaves[cp.leaf] + cp.offset, cp.host, cp.nbytes, H2D, side)
                    step.load_events[layer] = self._mark(side, step.device, step)
            if c in step.loads:
                self.rt.wait(stream, step.load_events[c])
            layer = c - 1
            if layer >= 0 and step.backups.get(layer):
                if layer == step.fail_at_layer:
                    return
                self.rt.wait(side, self._mark(stream, step.device, step))
                for cp in step.backups[layer]:
                    self.rt.memcpy(cp.host, leaves[cp.leaf] + cp.offset, cp.nbytes, D2H, side)
                step.backup_events[layer] = self._mark(side, step.device, step)
        except Exception as e:  # noqa: BLE001 - a ctypes callback cannot raise into XLA
            self.errors.append(repr(e))
            if step is not None:
                step.failed.append(repr(e))

    def _mark(self, stream: int, device: int, step: StepCopies | None = None) -> int:
        pair = self.event(device)
        self.rt.record(pair[1], stream)
        if step is not None:
            step.events.append(pair)
        return pair[1]

    # ---- outside the forward ---------------------------------------------------------------------
    def copy_now(self, device: int, copies: list[tuple[int, int, int, int]]) -> tuple[int, int]:
        """(dst, src, nbytes, kind) copies on the device's side stream, for data the host has already
        seen complete; returns the (device, event) that acknowledges them."""
        side = self.stream(device)
        for dst, src, nbytes, kind in copies:
            self.rt.memcpy(dst, src, nbytes, kind, side)
        pair = self.event(device)
        self.rt.record(pair[1], side)
        return pair

    def drain(self) -> None:
        for s in self.streams.values():
            self.rt.sync(s)


def page_runs(dev_pages, host_pages) -> np.ndarray:
    """[n, 3] runs (first device page, first host page, pages), in device page order: where both page
    lists advance by one the pages are one copy (allocators hand out pages in either direction)."""
    dev, host = np.asarray(dev_pages, np.int64), np.asarray(host_pages, np.int64)
    if len(dev) == 0:
        return np.zeros((0, 3), np.int64)
    order = np.argsort(dev, kind="stable")
    dev, host = dev[order], host[order]
    starts = np.r_[0, np.flatnonzero((np.diff(dev) != 1) | (np.diff(host) != 1)) + 1]
    return np.stack([dev[starts], host[starts], np.diff(np.r_[starts, len(dev)])], axis=1)


_registered: SideStreamCopier | None = None


def install() -> SideStreamCopier | None:
    """The process's copier for the default backend (registered once as the custom call's target):
    cudart on GPU, memmoves on CPU; None elsewhere or without libcudart."""
    global _registered
    if _registered is not None:
        return _registered
    backend = jax.default_backend()
    if backend == "gpu":
        path = _find_cudart()
        if path is None:
            return None
        rt, platform = CudaRuntime(path), "CUDA"
    elif backend == "cpu":
        rt, platform = HostRuntime(), "cpu"
    else:
        return None
    copier = SideStreamCopier(rt)
    # legacy API v3: GPU (stream, buffers, opaque, len, status), CPU (out, inputs, opaque, len, status)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(ctypes.cast(copier._callback, ctypes.c_void_p).value),
                                platform=platform, api_version=0)
    _registered = copier
    return copier


@dataclasses.dataclass(frozen=True)
class LayerHook:
    """The forward's hook between layers (and after the last), a static argument of the step: the
    pool leaves and the hidden state pass through the custom call unchanged (aliased). The pool tells
    the copier where it is; taking the hidden state orders the call after every read of the pool by
    the layer before (they all feed it), so XLA can alias the pool in place instead of copying it
    around the call. `axes`: inside a shard_map, the mesh's axes in order; the device's position in
    the mesh is passed along (every device of the mesh runs the hook, the replicas of a CP rank's
    pool over 'ep'/'tp' included, and each consumes its own copies)."""
    axes: tuple[str, ...] = ()

    def __call__(self, cache, x):
        leaves, tree = jax.tree.flatten(cache)
        index = jnp.int32(0) if not self.axes else jax.lax.axis_index(self.axes).astype(jnp.int32)
        args = leaves + [x, index]
        out = jax.ffi.ffi_call(TARGET, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args],
                               has_side_effect=True, input_output_aliases={i: i for i in range(len(args))},
                               custom_call_api_version=3, legacy_backend_config=str(len(leaves)))(*args)
        return jax.tree.unflatten(tree, out[:len(leaves)]), out[len(leaves)]
