"""The paper's figures that the study report puts beside ours (validation loss in nats/token of the
paper's tokenizer; only differences and ratios are compared with ours, which are in nats/byte).

Table 1 (360M, sync -> async) and Table 2 (async + error feedback) of the Async PP paper whose claim
this project tests (see the README), as its public summaries give them: its body was not available
to check the Adan and SOAP sync and async losses, so only their gaps are given.  The paper's small-scale protocol: ~20 tokens per parameter, warmup over 10% of the updates,
cosine to 10% of the peak, weight decay 0.1, clip 1.0, sync and async searched over the same grid,
on the order of 10^4 updates.
"""

from __future__ import annotations

# optimizer -> (sync, async) final validation loss at 360M (Table 1)
TABLE1 = {"adamw": (2.612, 2.890), "muon": (2.578, 2.590)}
# optimizer -> async - sync (Table 1)
GAP = {"adamw": 0.278, "muon": 0.012, "adan": 0.010, "soap": 0.027}
# optimizer -> (low, high) fraction of the gap error feedback recovers (Table 2; one figure: low == high)
EF_SHARE = {"adamw": (0.90, 0.90), "soap": (0.67, 0.67), "muon": (0.58, 0.71)}


def gap(opt: str) -> str:
    return f"{GAP[opt]:+.3f}" if opt in GAP else "-"


def ef_share(opt: str) -> str:
    if opt not in EF_SHARE:
        return "-"
    lo, hi = EF_SHARE[opt]
    return f"{lo:.0%}" if lo == hi else f"{lo:.0%}-{hi:.0%}"


def gap_ratio() -> float:
    """AdamW's gap over Muon's: 23x."""
    return GAP["adamw"] / GAP["muon"]
