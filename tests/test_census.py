"""``experiments.census``: the conditionals a call executes, counted in its jaxpr."""

import jax
from jax import lax

from experiments.census import census


def test_counts_nested_conds_switches_and_scan_lengths():
    def f(x):
        def body(c, _):
            # 1 cond + its costlier branch's 1 nested cond, then a 3-way switch: 3 per iteration
            c = lax.cond(c > 0, lambda: c - 1, lambda: lax.cond(c < -5, lambda: c, lambda: c + 2))
            c = lax.switch((c > 3).astype(int), [lambda: c, lambda: c * 2, lambda: c])
            return c, None

        c, _ = lax.scan(body, x, None, length=7)
        return jax.jit(lambda c: lax.cond(c > 0, lambda: c, lambda: -c))(c)  # under a pjit: still counted

    got = census(jax.make_jaxpr(f)(1.0))
    assert (got.conditionals, got.while_loops) == (7 * 3 + 1, 0)


def test_while_loop_body_counted_once_and_reported():
    def f(x):
        return lax.while_loop(lambda c: c < 10, lambda c: lax.cond(c > 2, lambda: c + 1, lambda: c + 2), x)

    got = census(jax.make_jaxpr(f)(0.0))
    assert (got.conditionals, got.while_loops) == (1, 1)
