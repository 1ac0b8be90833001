"""Counts over a traced program: how many conditionals one call executes.

Why it matters: XLA:GPU runs a ``lax.cond`` / ``lax.switch`` as a conditional thunk that copies
its predicate to the host before choosing the branch, so each one executed is a device-host
synchronization that a CPU does not show as a cost.  The engine's slot loop runs its
slots under conditionals; the benchmark (``experiments/bench_pipeline.py conditionals``) prints
this count per update.

Counting rule, for a closed jaxpr: each ``cond`` (a switch is one ``cond`` with several branches)
counts 1 plus the largest count among its branches (the branch taken is data-dependent, so this is
an upper bound), except a ``lax.platform_dependent`` one (the attention kernel's choice), which
lowering resolves: it counts only its largest branch; a Pallas kernel counts nothing; a ``scan`` counts its body ``length`` times; any other equation with sub-jaxprs
(``pjit``, ``shard_map``, ``remat``, custom derivatives) counts their sum.  A ``while`` loop's trip
count is not static: its body and condition are counted once and the loop is reported in
``Census.while_loops``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Census:
    conditionals: int  # executed per call (upper bound: the costliest branch of each)
    while_loops: int  # loops whose bodies were counted once (unknown trip count)


def subjaxprs(eqn):
    """The jaxprs inside an equation's parameters (a cond's branches, a scan's body, a shard_map's)."""
    for p in eqn.params.values():
        for sub in (p if isinstance(p, (list, tuple)) else [p]):
            inner = getattr(sub, "jaxpr", sub)
            if hasattr(inner, "eqns"):
                yield inner


def census(jaxpr) -> Census:
    """:class:`Census` of ``jaxpr`` (a ``ClosedJaxpr`` from ``jax.make_jaxpr``, or its ``.jaxpr``)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    conds = loops = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "pallas_call":  # a kernel's own control flow is the kernel's, not XLA conditionals
            continue
        subs = [census(s) for s in subjaxprs(eqn)]
        loops += sum(s.while_loops for s in subs)
        if name == "cond" and eqn.params.get("branches_platforms") is not None:
            # lax.platform_dependent: lowering keeps its platform's branch and no conditional
            conds += max((s.conditionals for s in subs), default=0)
        elif name == "cond":
            conds += 1 + max((s.conditionals for s in subs), default=0)
        elif name == "scan":
            conds += eqn.params["length"] * sum(s.conditionals for s in subs)
        else:
            conds += sum(s.conditionals for s in subs)
            loops += name == "while"
    return Census(conds, loops)
