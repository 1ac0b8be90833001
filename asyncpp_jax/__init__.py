"""asyncpp_jax: asynchronous pipeline-parallel LLM pretraining in JAX/Flax.

Importing the package is cheap and does not import JAX, so that ``asyncpp_jax.main`` can set
``XLA_FLAGS`` (fake CPU devices) before JAX starts.  Import the subpackages you need:
``asyncpp_jax.models``, ``asyncpp_jax.data``, ``asyncpp_jax.optim``, ``asyncpp_jax.train``.
"""

__version__ = "0.1.0"
