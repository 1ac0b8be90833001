"""Packaging beside pyproject.toml (which holds the metadata): the one thing pyproject cannot say.

The preset config files live in ``configs/`` at the repository root, where the docs point
(``--config=configs/tiny.py``); an install ships them inside the package, as
``asyncpp_jax/presets/``, so ``--config=tiny`` finds them from any directory.  They are never
installed as a top-level module named ``configs``.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["asyncpp_jax", "asyncpp_jax.*"]), "asyncpp_jax.presets"],
      package_dir={"asyncpp_jax.presets": "configs"})
