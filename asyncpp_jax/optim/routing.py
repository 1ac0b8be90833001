"""Parameter routing: hidden weight matrices to the matrix optimizer, the rest to AdamW.

Muon, SOAP and MARS are defined for the hidden layers' weight matrices (Jordan et al. 2024;
Vyas et al. 2024; Yuan et al. 2024). Embeddings, the LM head, norm scales and biases go to an AdamW
side branch. A leaf is a *hidden matrix* when it has at least two dimensions and no component of
its path matches ``adamw_pattern`` (default: embeddings, heads, norms, scales, biases).

Stacked layer leaves ``[layers, fan_in, fan_out]`` stay one leaf: the matrix optimizers treat the
leading axes as a batch of matrices, never flattening them into one matrix.

Routing is by name, so a model with automatic names (Flax's ``Dense_0 ... Dense_N``) sends its input
layer and output head to the matrix optimizer unless ``adamw_pattern`` names them (for Muon, SOAP and
MARS it is the ``pattern`` of their ``side=AdamWBranch(...)``, :mod:`asyncpp_jax.optim.adamw`). ``print_routing``
shows the table for any tree, and ``partition`` logs a warning, once per tree layout, when its
``init`` sees a hidden 2-D leaf that looks like a head or an embedding (``suspects``): Muon's and
SOAP's authors keep those on AdamW (Jordan et al. 2024; Vyas et al. 2024).
"""

from __future__ import annotations

import logging
import re

import jax
import numpy as np
import optax

log = logging.getLogger(__name__)

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


def _natural_key(name: str):
    # "Dense_2" before "Dense_10": the creation order of auto-named layers.
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def suspects(params, adamw_pattern: str = DEFAULT_ADAMW_PATTERN) -> dict[str, str]:
    """Hidden-routed 2-D leaves that are probably an input embedding or an output head: ``{path: why}``.

    A 2-D leaf is suspect when it is the first or the last matrix of the tree (paths in natural
    order, which for auto-named layers is the order they were created), or when one of its sides
    equals the vocabulary size (the longest side of a leaf routed to AdamW by an ``embed`` name).
    Stacked ``[layers, in, out]`` leaves are never suspects: they are the hidden layers.
    """
    leaves = [("/".join(path_names(p)), x, lab) for (p, x), lab in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves(label_params(params, adamw_pattern)))]
    matrices = sorted((x for x in leaves if np.ndim(x[1]) == 2), key=lambda x: _natural_key(x[0]))
    vocab = {max(np.shape(x)) for n, x, lab in leaves if lab == ADAMW and np.ndim(x) >= 2 and "embed" in n.lower()}
    found = {}
    for i, (name, x, lab) in enumerate(matrices):
        if lab != HIDDEN:
            continue
        if i in (0, len(matrices) - 1) and len(matrices) > 1:
            found[name] = "first matrix" if i == 0 else "last matrix"
        elif vocab & set(np.shape(x)):
            found[name] = f"a side equals the vocabulary size {max(vocab & set(np.shape(x)))}"
    return found


_WARNED: set = set()


def warn_suspects(params, adamw_pattern: str = DEFAULT_ADAMW_PATTERN) -> dict[str, str]:
    """Log ``suspects`` as a warning, once per tree layout and pattern in this process; returns them."""
    found = suspects(params, adamw_pattern)
    key = (adamw_pattern, tuple(sorted((k, v) for k, v in found.items())))
    if found and key not in _WARNED:
        _WARNED.add(key)
        log.warning(
            "the matrix optimizer (Muon/SOAP/MARS) gets %d leaf(s) that look like an embedding or an output "
            "head: %s. Send them to the AdamW side with its pattern (now %r), e.g. "
            "side=AdamWBranch(pattern=%r) or config.optimizer.adamw_pattern; "
            "asyncpp_jax.optim.print_routing(params, pattern) shows the table.", len(found),
            ", ".join(f"{k} ({v})" for k, v in found.items()), adamw_pattern,
            "|".join([adamw_pattern] * bool(adamw_pattern) + [f"^{k.split('/')[-2]}$" for k in found
                                                                 if len(k.split("/")) > 1]))
    return found


def partition(
    hidden_tx: optax.GradientTransformation,
    adamw_tx: optax.GradientTransformation,
    adamw_pattern: str = DEFAULT_ADAMW_PATTERN,
) -> optax.GradientTransformation:
    """``hidden_tx`` on hidden matrices, ``adamw_tx`` on everything else (``optax.partition``).

    ``init`` warns about hidden leaves that look like a head or an embedding (``warn_suspects``).
    """
    inner = optax.partition({HIDDEN: hidden_tx, ADAMW: adamw_tx}, lambda p: label_params(p, adamw_pattern))

    def init_fn(params):
        warn_suspects(params, adamw_pattern)
        return inner.init(params)

    return optax.GradientTransformationExtraArgs(init_fn, inner.update)


def describe(params, adamw_pattern: str = DEFAULT_ADAMW_PATTERN, branch_names: dict | None = None) -> str:
    """A human-readable table: each parameter path, its shape, and the branch it goes to.

    ``branch_names`` renames the labels for display, e.g. ``{'hidden': 'muon'}``.
    """
    names = {HIDDEN: HIDDEN, ADAMW: ADAMW, **(branch_names or {})}
    labels = label_params(params, adamw_pattern)
    flagged = suspects(params, adamw_pattern)
    rows = []
    for (path, leaf), lab in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves(labels)
    ):
        name = "/".join(path_names(path))
        note = f"  <- head or embedding? ({flagged[name]})" if name in flagged else ""
        rows.append((name, "x".join(map(str, np.shape(leaf))), names[lab] + note))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"{'parameter':<{w0}}  {'shape':<{w1}}  branch"]
    lines += [f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
    return "\n".join(lines)


def print_routing(params, adamw_pattern: str = DEFAULT_ADAMW_PATTERN, branch_names: dict | None = None) -> None:
    """Print ``describe``'s table: where each leaf of any tree goes, with suspect leaves marked."""
    print(describe(params, adamw_pattern, branch_names))
