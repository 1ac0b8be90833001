"""The paper's studies, one module each: ``study(preset) -> experiments.study.Study``."""
