"""Multi-process runs (jax.distributed): start-up, and the one scheduling stream every process follows.

Every process runs the same program: the same engine (its mesh over every process's devices), the same
host-side scheduling and the same jitted steps; JAX's collectives (NCCL on GPU, gloo on CPU) carry the
data between them. The scheduler is deterministic, so processes that see the same requests make the
same decisions; the only input that must travel is the requests themselves, which process 0 receives
(`cpkv-jax serve`) and broadcasts with `multihost_utils.broadcast_one_to_all` before each step. With
PD (cpkv_jax.pd) a decode replica runs only on the process owning its device, which broadcasts what
its steps decide and sample (`broadcast_object(..., source=owner)`).
"""

from __future__ import annotations

import pickle

import jax
import numpy as np


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    """jax.distributed.initialize from the usual flags ('auto' or None: JAX's cluster auto-detection).
    CPU collectives go over gloo (XLA:CPU has no cross-process collectives without it)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if coordinator in (None, "auto"):
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator, num_processes, process_id)


def broadcast_object(obj, source: int = 0):
    """Process `source`'s `obj` on every process (any picklable value; the others pass anything): its
    length, then its bytes, padded to a power of two so that the broadcasts compile a bounded number of
    programs. Every process must call it, in the same order, with the same `source`."""
    from jax.experimental import multihost_utils
    if jax.process_count() == 1:
        return obj
    me = jax.process_index() == source
    data = np.frombuffer(pickle.dumps(obj), np.uint8) if me else np.zeros(0, np.uint8)
    n = int(multihost_utils.broadcast_one_to_all(np.array(len(data), np.int64), is_source=me))
    padded = np.zeros(1 << max(6, (n - 1).bit_length()), np.uint8)
    if me:
        padded[:n] = data
    out = multihost_utils.broadcast_one_to_all(padded, is_source=me)
    return pickle.loads(np.asarray(out)[:n].tobytes())


def portable(cmd) -> tuple:
    """The part of a server command (cpkv_jax.server.EngineLoop) the other processes need: what to add
    (token ids, SamplingParams) or which request to abort."""
    return ("add", cmd[1], cmd[2]) if cmd[0] == "add" else ("abort", cmd[1])


def follow(engine) -> None:
    """A process other than 0 of a multi-process server: apply process 0's commands in its order and
    step whenever it does (the same engine state on every process makes the same decisions), until
    process 0 stops."""
    from cpkv_jax.engine import EngineInputError
    from cpkv_jax.sampling import SamplingError
    while True:
        for cmd in broadcast_object(None):
            if cmd[0] == "stop":
                return
            if cmd[0] == "add":
                try:
                    engine.add_request(cmd[1], cmd[2], stream_text=True)
                except (EngineInputError, SamplingError):
                    pass                      # process 0 refused it too: no request id was used
            elif cmd[1] in engine._requests:
                engine.abort(cmd[1])
                engine.output(cmd[1])
        if engine.has_unfinished():
            for ev in engine.step():
                if ev.finish_reason is not None:
                    engine.output(ev.rid)
