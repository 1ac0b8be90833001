"""PipeDream's exact mixed-version gradient in the simulate runner (``optim.WeightVersions``).

References are hand-written loops that keep the full weight history and build the mixed point
``(w_0[t-(P-1)], ..., w_{P-1}[t])`` slice by slice, with the ``delay`` conventions (fill steps give
a zero gradient on their slices; the delay is off outside ``K <= t < T - C``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from asyncpp_jax.models import dense
from asyncpp_jax.optim import DelaySchedule, WeightVersions, delay, pipedream_leaf_delays
from helpers import run_simulate_runner, tiny_model_cfg
from helpers import token_batches as batches

N_LAYERS = 4


def model_cfg(tie=False):
    return tiny_model_cfg(N_LAYERS, tie)


def run_runner(cfg, tx, data, mesh, versions=None):
    """The real simulate runner: returns the params after every update."""
    return run_simulate_runner(cfg, tx, data, mesh, history=True, weight_versions=versions)


def mean_grad_fn(cfg):
    """The mean of the per-microbatch gradients, written without the runner's scan or shard_map."""
    grad = jax.jit(jax.grad(lambda p, mb: dense.loss_fn(cfg, p, mb)[0]))

    def mean_grad(params, batch):
        grads = [grad(params, mb) for mb in batch]
        return jax.tree.map(lambda *g: sum(g) / len(g), *grads)

    return mean_grad


def reference_sgd(cfg, data, leaf_delays, lr, K=0, C=0, T=None):
    """SGD at PipeDream's mixed point, from the full weight history (no rings, no counters)."""
    params = jax.tree.map(np.asarray, dense.init_params(cfg, jax.random.key(0)))
    hist = [jax.tree.leaves(params)]
    treedef = jax.tree.structure(params)
    delays = treedef.flatten_up_to(leaf_delays)
    on = lambda t: t >= K and (C == 0 or t < T - C)  # noqa: E731
    mean_grad = mean_grad_fn(cfg)

    def pick(t, j, d, w):
        """(weights to differentiate at, fill?) for leaf j, or one layer slice of it, at update t."""
        delayed = d > 0 and on(t)
        ready = delayed and on(t - d)
        return (hist[t - d][j] if ready else w), (delayed and not ready)

    for t, b in enumerate(data):
        mixed, fill = [], []
        for j, (w, d) in enumerate(zip(hist[t], delays)):
            if np.ndim(d) == 0:
                x, f = pick(t, j, int(d), w)
                mixed.append(x)
                fill.append(np.asarray(f))
            else:  # stacked layers: slice i along the leading axis has delay d[i]
                picks = [pick(t, j, int(di), w) for di in d]
                mixed.append(np.stack([x[i] for i, (x, _) in enumerate(picks)]))
                fill.append(np.asarray([f for _, f in picks]).reshape((-1,) + (1,) * (w.ndim - 1)))
        g = jax.tree.leaves(mean_grad(treedef.unflatten([jnp.asarray(x) for x in mixed]), b))
        hist.append([w - lr * np.where(f, 0.0, np.asarray(gg)) for w, gg, f in zip(hist[t], g, fill)])
    return [treedef.unflatten(h) for h in hist]


def assert_trees_close(a, b, **kw):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, err_msg=jax.tree_util.keystr(path), **kw)


# (4, 0, 0): (4, 2, 2) runs the same 4 stages, with a synchronous start and cooldown.
@pytest.mark.parametrize("n_stages, K, C", [(2, 0, 0), pytest.param(4, 0, 0, marks=pytest.mark.slow), (4, 2, 2)])
def test_runner_takes_the_gradient_at_the_mixed_point(mesh, n_stages, K, C):
    cfg, n, lr = model_cfg(), 9, 0.5
    data = batches(n)
    abstract = dense.abstract_params(cfg)
    leaf_delays = pipedream_leaf_delays(abstract, n_stages)
    versions = WeightVersions(leaf_delays, DelaySchedule(1, K, C, n if C else None))
    got = run_runner(cfg, optax.sgd(lr), data, mesh, versions)
    want = reference_sgd(cfg, data, leaf_delays, lr, K, C, n)
    for t in range(n + 1):
        assert_trees_close(got[t], want[t], rtol=2e-5, atol=2e-6)
    if K == 0:  # not vacuous: the mixed point really mixes, so the result differs from synchronous SGD
        sync = run_runner(cfg, optax.sgd(lr), data[:2], mesh)
        assert np.max(np.abs(got[2]["lm_head"]["kernel"] - sync[2]["lm_head"]["kernel"])) > 1e-3


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_all_delays_one_is_2bw_with_batches_relabelled(mesh, opt):
    """Every slice at delay 1: update t takes batch t at w[t-1]; delay(1) applies batch t-1's at w[t-1]."""
    cfg, n = model_cfg(tie=True), 7
    make = lambda: optax.sgd(0.5) if opt == "sgd" else optax.adamw(3e-3, weight_decay=0.1)  # noqa: E731
    data = batches(n + 1, seed=1)
    ones = jax.tree.map(lambda _: 1, dense.abstract_params(cfg))
    mixed = run_runner(cfg, make(), data[:n], mesh, WeightVersions(ones, DelaySchedule(1)))
    # Mixed update t differentiates data[t] at w[t-1]; 2BW update t applies its batch t-1 at w[t-1].
    # So 2BW reads data[1:]; update 0 is a fill step in both, so mixed's data[0] never matters.
    two_bw = run_runner(cfg, optax.chain(delay(1), make()), data[1:], mesh)
    for t in range(n + 1):
        assert_trees_close(mixed[t], two_bw[t], rtol=1e-6, atol=1e-7)


def test_mixed_gradient_differs_from_the_per_leaf_approximation(mesh):
    """The per-leaf delay evaluates stage s's slice at the all-stale point w[t-d_s]; PipeDream mixes."""
    cfg, n_stages = model_cfg(), 4
    abstract = dense.abstract_params(cfg)
    leaf_delays = pipedream_leaf_delays(abstract, n_stages)
    data = batches(6, seed=2)
    exact = run_runner(cfg, optax.sgd(0.5), data, mesh, WeightVersions(leaf_delays, DelaySchedule(1)))
    approx = run_runner(cfg, optax.chain(delay(leaf_delays=leaf_delays), optax.sgd(0.5)), data, mesh)
    # Update 0: every slice with d > 0 fills in both, and the head (d = 0) sees the same fresh gradient.
    assert_trees_close(exact[1], approx[1], rtol=1e-6, atol=1e-7)
    # Later the head's gradient is taken at w_head[t] with stale layers (exact) versus fully fresh
    # (approximation), so they part.
    diff = np.max(np.abs(exact[3]["lm_head"]["kernel"] - approx[3]["lm_head"]["kernel"]))
    assert diff > 1e-4


def test_state_holds_p_minus_one_weight_copies_of_delayed_leaves():
    cfg = model_cfg()
    abstract = dense.abstract_params(cfg)
    versions = WeightVersions(pipedream_leaf_delays(abstract, 4), DelaySchedule(1))
    state = jax.eval_shape(versions.init, abstract)
    assert state.weight_ring["layers"]["mlp"]["up"]["kernel"].shape == (3,) + abstract["layers"]["mlp"]["up"]["kernel"].shape
    assert state.weight_ring["embed"]["embedding"].shape == (3,) + abstract["embed"]["embedding"].shape
    assert state.weight_ring["lm_head"]["kernel"].shape == ()  # the last stage is never stale
