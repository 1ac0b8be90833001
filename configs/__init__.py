"""Experiment configs: each module has ``get_config() -> ml_collections.ConfigDict``."""
