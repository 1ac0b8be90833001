"""The paper's studies, one module each: ``study(preset) -> experiments.sweep.Study``."""
