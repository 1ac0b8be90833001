"""AdamW's and Muon's delay gap and error feedback's recovered fraction at every learning rate of
the ``lr`` study's grid: sync, 2BW and 2BW + EF (variants ``OPT/lr=VALUE/ARM``).  The sync arms
are the ``lr`` study's runs, copied by the sweep when that study has been run under the same
``--out``; run ``lr`` first.
"""

from experiments.studies import lr
from experiments.studies.common import preset
from experiments.study import Study


def study(name: str) -> Study:
    config, base, seeds, note = preset(name)
    return Study("lr_gap", config, lr.variants_of(name, lr.DELAYED, tuple(lr.ARMS)), seeds=lr.seeds_of(name, seeds),
                 base=base, note=note)
