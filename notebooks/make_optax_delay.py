"""Writes notebooks/optax_delay.ipynb (run from the repository root); edit this, not the JSON."""
import nbformat as nbf

nb = nbf.v4.new_notebook()
md = nbf.v4.new_markdown_cell
code = nbf.v4.new_code_cell
nb.cells = [
    md("""# Gradient delay and error feedback as optax transforms, in your own JAX loop

`asyncpp_jax.optim` exports the staleness transforms as ordinary `optax.GradientTransformation`s,
so they wrap any optimizer in any training loop, with no trainer, config or model of this package:

```python
tx = optax.chain(delay(1), optax.adamw(lr))                    # PipeDream-2BW's one-step delay
tx = optax.chain(delay(1), optax.adamw(lr), error_feedback())  # the same, with error feedback
```

`delay(d)` hands the optimizer the gradient from `d` updates ago (the first `d` updates are fill
steps with a zero gradient); `error_feedback()` sits after the optimizer and adds
`strength * (u_t - u_{t-1})` to its update `u_t`, extrapolating the update one step forward.

Below, a small MLP regresses a fixed random "teacher" MLP; plain JAX (`jax.grad`, `jax.jit`,
`optax.apply_updates`). AdamW and Muon (Muon on the hidden matrix, AdamW on the rest) each train
synchronously, with a one-step delay, and with the delay plus error feedback. Runs in seconds on a
CPU."""),
    code("""import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from asyncpp_jax.optim import AdamWBranch, delay, error_feedback, muon

STEPS = int(os.environ.get("OPTAX_DELAY_STEPS", "300"))
D_IN, HIDDEN, BATCH, LR = 16, 64, 64, 3e-2


def init_mlp(key, scale=1.0):
    k1, k2, k3 = jax.random.split(key, 3)
    return {"w1": scale * jax.random.normal(k1, (D_IN, HIDDEN)) / np.sqrt(D_IN), "b1": jnp.zeros(HIDDEN),
            "w2": scale * jax.random.normal(k2, (HIDDEN, HIDDEN)) / np.sqrt(HIDDEN), "b2": jnp.zeros(HIDDEN),
            "w3": scale * jax.random.normal(k3, (HIDDEN, 1)) / np.sqrt(HIDDEN)}


def mlp(p, x):
    h = jax.nn.gelu(x @ p["w1"] + p["b1"])
    h = jax.nn.gelu(h @ p["w2"] + p["b2"])
    return h @ p["w3"]


teacher = init_mlp(jax.random.key(0), scale=2.0)


def batch(step):
    x = jax.random.normal(jax.random.fold_in(jax.random.key(1), step), (BATCH, D_IN))
    return x, mlp(teacher, x)


def loss_fn(p, x, y):
    return jnp.mean((mlp(p, x) - y) ** 2)


x_val, y_val = batch(10**6)  # a held-out batch
print(f"{sum(x.size for x in jax.tree.leaves(init_mlp(jax.random.key(2))))} parameters, {STEPS} updates")"""),
    md("""The training loop is the same for every optimizer: only `tx` changes. The delayed gradient
lives in `tx`'s state (`opt_state`), so it is checkpointed with the rest of the state."""),
    code("""def train(tx, steps=STEPS):
    params = init_mlp(jax.random.key(2))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for t in range(steps):
        params, opt_state, loss = step(params, opt_state, *batch(t))
        losses.append(float(loss))
    return np.array(losses), float(loss_fn(params, x_val, y_val))


# Muon on the hidden matrix w2; the input and output matrices and the biases go to its AdamW side
# (AdamWBranch's pattern is a regex on the parameter path; optim.print_routing(params, pattern) shows the split).
optimizers = {"AdamW": lambda: optax.adamw(LR, weight_decay=0.0),
              "Muon": lambda: muon(LR, weight_decay=0.0, side=AdamWBranch(pattern="w1|w3|b"))}
arms = {"sync": lambda make: make(),
        "delay(1)": lambda make: optax.chain(delay(1), make()),
        "delay(1) + EF": lambda make: optax.chain(delay(1), make(), error_feedback())}
curves, final = {}, {}
for opt_name, make in optimizers.items():
    for arm, wrap in arms.items():
        t0 = time.time()
        curves[opt_name, arm], final[opt_name, arm] = train(wrap(make))
        print(f"{opt_name:5s} {arm:13s} held-out loss {final[opt_name, arm]:.5f}  ({time.time() - t0:.1f} s)")"""),
    md("""How much of the delay's cost error feedback recovers: `(delayed - delayed+EF) / (delayed - sync)`
on the held-out loss (1 = all of it; on a problem this small the figure varies with the seed and the
learning rate, so read it as a demonstration of the API, not as a result)."""),
    code("""for opt_name in optimizers:
    s, d, e = (final[opt_name, a] for a in arms)
    gap = d - s
    print(f"{opt_name:5s} delay gap {gap:+.5f}; EF recovers {(d - e) / gap:.0%}" if gap > 0 else
          f"{opt_name:5s} delay gap {gap:+.5f} (no gap to recover at this size)")"""),
    code("""# Training curves (a running mean over 10 updates).
import matplotlib
if "ipykernel" not in __import__("sys").modules or os.environ.get("OPTAX_DELAY_STEPS"):
    matplotlib.use("Agg")
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, len(optimizers), figsize=(10, 3.5), sharey=True)
for ax, opt_name in zip(axes, optimizers):
    for arm in arms:
        c = curves[opt_name, arm]
        ax.plot(np.convolve(c, np.ones(10) / 10, mode="valid"), label=arm)
    ax.set(title=opt_name, xlabel="update", yscale="log")
axes[0].set_ylabel("training loss")
axes[0].legend()
fig.tight_layout()
out = os.environ.get("OPTAX_DELAY_OUT")
if out:
    fig.savefig(os.path.join(out, "optax_delay.png"))"""),
]
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
nbf.write(nb, "notebooks/optax_delay.ipynb")
