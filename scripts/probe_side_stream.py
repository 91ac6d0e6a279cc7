"""Side-stream copy probe on a synthetic 16-layer scan (H200): step time plain, with the layer hook, with per-layer backups (and loads) on the side stream, and with the copy serialized after the step; checks the copied bytes against a reference. Writes probe.json under $OUT."""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp, numpy as np
from cpkv_jax.hicache import side_stream as ss

cp = ss.install()
print("cudart", cp.rt.path, flush=True)
L, N, W, D = int(os.environ.get("L", 16)), 32768, 576, 4096
BF = jnp.bfloat16
rng = np.random.default_rng(0)
host_np = np.zeros((L, 2 * N, W), np.dtype(BF))
host_np[:, :N] = rng.standard_normal((L, N, W)).astype(np.dtype(BF))
host = jax.device_put(host_np, jax.memory.Space.Host)
hptr = host.addressable_data(0).unsafe_buffer_pointer()
attrs = (__import__("ctypes").c_int * 64)()
cp.rt("cudaPointerGetAttributes", attrs, __import__("ctypes").c_void_p(hptr))
print("host ptr type", attrs[0], "(1=host pinned)", flush=True)
w = jnp.asarray(rng.standard_normal((D, D)) / 64, BF)
x0 = jnp.asarray(rng.standard_normal((N, D)), BF)


def make(hook):
    def step(pool, x, w):
        def body(carry, l):
            pool, x = carry
            if hook:
                pool, x = ss.LayerHook()(pool, x)
            x = jnp.tanh(x @ w)
            x = jnp.tanh(x @ w)
            seen = jax.lax.dynamic_slice(pool, (l, 0, 0), (1, N, W))[0]
            new = (x[:, :W].astype(jnp.float32) + seen.astype(jnp.float32)).astype(BF)
            pool = jax.lax.dynamic_update_slice(pool, new[None], (l, N, 0))
            return (pool, x), None
        (pool, x), _ = jax.lax.scan(body, (pool, x), jnp.arange(L))
        if hook:
            pool, x = ss.LayerHook()(pool, x)
        return pool, x
    return jax.jit(step, donate_argnums=(0,))

plain, hooked = make(False), make(True)
RB = N * W * 2
def plan(loads, backups):
    s = ss.StepCopies(L + 1, 0)
    for l in range(L):
        if loads:
            s.loads[l] = [ss.Copy(0, l * 2 * RB, hptr + l * 2 * RB, RB)]
        if backups:
            s.backups[l] = [ss.Copy(0, (l * 2 + 1) * RB, hptr + (l * 2 + 1) * RB, RB)]
    return s

# reference: pool pre-filled with the host rows
ref_pool, ref_x = plain(jnp.asarray(host_np), x0, w)
ref_rows = np.asarray(ref_pool[:, N:])
res = {}
def timeit(name, fn, n=5):
    ts = []
    for i in range(n + 1):
        t = time.perf_counter(); out = fn(); ts.append(time.perf_counter() - t)
    res[name] = float(np.median(ts[1:])) * 1e3
    print(f"{name}: {res[name]:.2f} ms", flush=True)
    return out

def run_plain():
    p, x = plain(jnp.zeros((L, 2 * N, W), BF), x0, w); jax.block_until_ready(p); return p
def run_hook(loads, backups, wait_side=True):
    pool = jnp.zeros((L, 2 * N, W), BF); jax.block_until_ready(pool)
    ptr_in = pool.unsafe_buffer_pointer()
    s = plan(loads, backups); cp.push(s)
    p, x = hooked(pool, x0, w); jax.block_until_ready(p)
    if wait_side: cp.drain()
    return p, s, ptr_in
timeit("plain", run_plain)
timeit("hook_empty", lambda: run_hook(False, False))
timeit("hook_backup_step_only", lambda: run_hook(False, True, wait_side=False)); cp.drain()
timeit("hook_backup_incl_drain", lambda: run_hook(False, True))
timeit("hook_load_backup_incl_drain", lambda: run_hook(True, True))
def serial():
    p = run_plain()
    ptr = p.unsafe_buffer_pointer()
    ev = cp.copy_now(0, [(hptr + (l * 2 + 1) * RB, ptr + (l * 2 + 1) * RB, RB, ss.D2H) for l in range(L)])
    cp.drain(); return p
timeit("serial_copy_after", serial)

p, s, ptr_in = run_hook(True, True)
print("errors", cp.errors, "failed", s.failed, flush=True)
addrs = s.pool_addresses
print("addresses seen", len(addrs), "in", ptr_in, "seen", [a[0] for a in addrs], "out", p.unsafe_buffer_pointer())
dev_rows = np.asarray(p[:, N:])
host_after = np.asarray(jax.device_put(host, jax.memory.Space.Device))
res["device_equal_ref"] = bool((dev_rows.view(np.uint16) == ref_rows.view(np.uint16)).all())
res["host_equal_ref"] = bool((host_after[:, N:].view(np.uint16) == ref_rows.view(np.uint16)).all())
res["events_done"] = all(s.layer_done(l, cp.rt) for l in range(L))
res["bytes_per_step"] = L * RB
res["d2h_gbps_if_hidden"] = L * RB / (res["hook_backup_incl_drain"] / 1e3) / 1e9
print(json.dumps(res, indent=1))
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.json"), "w"), indent=1)
