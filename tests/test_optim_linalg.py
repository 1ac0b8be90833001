"""The CPU replacements for batched LAPACK (``asyncpp_jax.optim.linalg``), and SOAP free of the deadlock.

jaxlib 0.10.2's batched LAPACK kernels can deadlock XLA:CPU's worker pool on 2+ cores. On CPU the
package lowers QR and ``eigh`` to LAPACK on the host (SciPy, NumPy); these tests check the two agree
with NumPy, that the CPU lowering holds no LAPACK call while the
GPU/TPU lowerings keep the library's, and that many refresh-heavy SOAP updates finish on 2+ threads.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asyncpp_jax.optim.linalg import eigh_vectors, qr_q
from asyncpp_jax.optim.soap import scale_by_soap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _match_up_to_signs(q, want):
    signs = np.sign(np.sum(q * want, axis=-2, keepdims=True))
    return q * signs


# Square, tall, batched and 1x1, in both float dtypes.
@pytest.mark.parametrize("shape", [(3, 40, 40), (70, 70), (2, 90, 70), (1, 1)])
@pytest.mark.parametrize("dtype,atol", [(np.float64, 1e-13), (np.float32, 2e-5)])
def test_qr_matches_lapack_well_conditioned(shape, dtype, atol):
    a = np.random.default_rng(0).standard_normal(shape)
    with jax.enable_x64(True):
        q = np.asarray(jax.jit(qr_q)(a.astype(dtype)))
    assert q.dtype == dtype and q.shape == shape
    # LAPACK's sign convention (dgeqrf): equal to NumPy's Q column for column, signs included.
    np.testing.assert_allclose(q, np.linalg.qr(a)[0], atol=atol)


def test_qr_rank_deficient_stays_orthogonal():
    # L Q in SOAP can be rank-deficient; a Householder QR (LAPACK's) keeps Q orthonormal, spanning A's columns.
    rng = np.random.default_rng(2)
    a = rng.standard_normal((2, 40, 5)) @ rng.standard_normal((2, 5, 40))
    a[1, :, 7] = 0.0
    with jax.enable_x64(True):
        q = np.asarray(jax.jit(qr_q)(a))
    np.testing.assert_allclose(np.swapaxes(q, -1, -2) @ q, np.broadcast_to(np.eye(40), q.shape), atol=1e-13)
    np.testing.assert_allclose(q @ np.swapaxes(q, -1, -2) @ a, a, atol=1e-11)


def test_qr_under_vmap_matches_batched_call():
    a = np.random.default_rng(4).standard_normal((3, 2, 12, 12)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(qr_q))(a)), np.asarray(jax.jit(qr_q)(a)))


def test_qr_rejects_wide_input():
    with pytest.raises(ValueError, match="tall or square"):
        qr_q(jnp.zeros((3, 4)))


def test_eigh_vectors_match_numpy():
    rng = np.random.default_rng(3)
    g = rng.standard_normal((3, 24, 30)).astype(np.float32)
    s = g @ np.swapaxes(g, -1, -2)  # distinct eigenvalues: vectors unique up to sign
    vecs = np.asarray(jax.jit(eigh_vectors)(s))
    assert vecs.dtype == np.float32
    want = np.linalg.eigh(s.astype(np.float64))[1]
    np.testing.assert_allclose(_match_up_to_signs(vecs, want), want, atol=2e-3)
    # and under vmap (the callback takes the batch as one call)
    vm = np.asarray(jax.jit(jax.vmap(eigh_vectors))(s))
    np.testing.assert_allclose(vm, vecs, atol=1e-6)


def _custom_calls(fn, x, platform):
    text = jax.jit(fn).trace(x).lower(lowering_platforms=(platform,)).as_text()
    return set(re.findall(r"stablehlo\.custom_call @(\w+)", text))


def test_soap_lowering_has_no_lapack_on_cpu_and_library_calls_elsewhere():
    tx = scale_by_soap(precondition_frequency=1)
    params = {"w": jnp.zeros((2, 8, 6))}
    state = tx.init(params)
    fn = lambda g: tx.update(g, state)  # noqa: E731  (both the eigh and the QR branch are in it)
    assert _custom_calls(fn, params, "cpu") == {"xla_ffi_python_cpu_callback"}
    assert {"cusolver_geqrf_ffi", "cusolver_syevd_ffi"} <= _custom_calls(fn, params, "cuda")
    assert {"Qr", "Eigh"} <= _custom_calls(fn, params, "tpu")


# Many refresh-every-step SOAP updates on batched matrices, jitted. The batched-LAPACK version of
# this loop froze within a few updates on 2 cores (jaxlib 0.10.2). A watchdog thread ends the child
# with code 3 when its CPU time stops advancing (a deadlock: every worker blocked), so the test
# fails promptly instead of waiting for the hard timeout.
_SOAP_LOOP = textwrap.dedent("""
    import os, threading, time
    import jax, jax.numpy as jnp
    from asyncpp_jax.optim.soap import scale_by_soap

    def watchdog():
        last = time.process_time()
        while True:
            time.sleep(20)
            now = time.process_time()
            if now - last < 0.05:
                print("deadlock: no CPU time used in 20 s", flush=True)
                os._exit(3)
            last = now

    threading.Thread(target=watchdog, daemon=True).start()
    tx = scale_by_soap(precondition_frequency=1)
    shapes = {"a": (4, 256, 256), "b": (4, 128, 256)}
    state = tx.init({k: jnp.zeros(s) for k, s in shapes.items()})
    step = jax.jit(tx.update)
    for i in range(UPDATES):
        g = {k: jax.random.normal(jax.random.key(10 * i + j), s) for j, (k, s) in enumerate(shapes.items())}
        u, state = step(g, state)
        jax.block_until_ready(u)
    print("completed", int(state.count), "threads", len(os.sched_getaffinity(0)), flush=True)
""")


@pytest.mark.slow  # ~15 s on an idle 2-core machine: a JAX start, compiles and 30 refreshes
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="the deadlock needs XLA:CPU running on 2+ cores")
def test_soap_refresh_loop_completes_on_two_threads():
    updates = 30
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    try:
        proc = subprocess.run([sys.executable, "-c", _SOAP_LOOP.replace("UPDATES", str(updates))], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"SOAP update loop did not finish in 600 s (deadlock?); output: {e.stdout!r}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"SOAP update loop failed (rc {proc.returncode}):\n{out[-3000:]}"
    assert f"completed {updates}" in out
