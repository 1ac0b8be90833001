"""Parameter routing: hidden weight matrices to the matrix optimizer, the rest to AdamW.

Muon, SOAP and MARS are defined for the hidden layers' weight matrices (Jordan et al. 2024;
Vyas et al. 2024; Yuan et al. 2024). Embeddings, the LM head, norm scales and biases go to an AdamW
side branch. A leaf is a *hidden matrix* when it has at least two dimensions and no component of
its path matches ``adamw_pattern`` (default: embeddings, heads, norms, scales, biases).

Stacked layer leaves ``[layers, fan_in, fan_out]`` stay one leaf: the matrix optimizers treat the
leading axes as a batch of matrices, never flattening them into one matrix.
"""

from __future__ import annotations

import re

import jax
import optax

HIDDEN, ADAMW = "hidden", "adamw"
DEFAULT_ADAMW_PATTERN = r"embed|lm_head|head|norm|scale|bias|router"


def path_names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def label_params(params, adamw_pattern: str = DEFAULT_ADAMW_PATTERN):
    """A tree like ``params`` with ``'hidden'`` or ``'adamw'`` at each leaf."""
    rx = re.compile(adamw_pattern) if adamw_pattern else None

    def label(path, leaf):
        names = path_names(path)
        side = leaf.ndim < 2 or (rx is not None and any(rx.search(n) for n in names))
        return ADAMW if side else HIDDEN

    return jax.tree_util.tree_map_with_path(label, params)


def partition(
    hidden_tx: optax.GradientTransformation,
    adamw_tx: optax.GradientTransformation,
    adamw_pattern: str = DEFAULT_ADAMW_PATTERN,
) -> optax.GradientTransformation:
    """``hidden_tx`` on hidden matrices, ``adamw_tx`` on everything else (``optax.partition``)."""
    return optax.partition(
        {HIDDEN: hidden_tx, ADAMW: adamw_tx}, lambda p: label_params(p, adamw_pattern)
    )


def describe(params, adamw_pattern: str = DEFAULT_ADAMW_PATTERN, branch_names: dict | None = None) -> str:
    """A human-readable table: each parameter path, its shape, and the branch it goes to.

    ``branch_names`` renames the labels for display, e.g. ``{'hidden': 'muon'}``.
    """
    names = {HIDDEN: HIDDEN, ADAMW: ADAMW, **(branch_names or {})}
    labels = label_params(params, adamw_pattern)
    rows = []
    for (path, leaf), lab in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves(labels)
    ):
        rows.append(("/".join(path_names(path)), "x".join(map(str, leaf.shape)), names[lab]))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"{'parameter':<{w0}}  {'shape':<{w1}}  branch"]
    lines += [f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
    return "\n".join(lines)
