"""Schedules as programs: per-device action lists (:mod:`.programs`: the generators, the
validator, the discrete-event simulator and the delays) and a program compiled into lock-step
slots with buffer entries (:mod:`.slot_plan`).  Plain Python and NumPy, no JAX: the config's
validator checks a schedule here, and both placements run what it compiles."""
