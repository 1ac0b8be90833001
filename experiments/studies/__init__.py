"""The paper's studies, one module each: ``study(preset) -> experiments.study.Study``, and the
study's own report section, ``analyse(name, rows, arms, out, claims) -> list of lines`` (optional)."""
