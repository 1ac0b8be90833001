"""The pipeline engine: every schedule is a program, and one executor runs any valid program.

* :mod:`~asyncpp_jax.pipeline.programs`: schedules as per-device action lists (``sync``, ``1f1b``,
  ``interleaved``, ``zb-h1``, ``2bw``, ``pipedream``, the forward-only eval program), their
  generators, validator and discrete-event simulator, and the delays (which weight version an
  action reads, which update its gradient joins). Plain Python.
* :mod:`~asyncpp_jax.pipeline.slot_plan`: a program compiled into lock-step slots and buffer entries.
* :mod:`~asyncpp_jax.pipeline.engine`: the SPMD train step (``shard_map`` over ``('data', 'stage')``,
  a ``lax.scan`` over the slots: :mod:`~asyncpp_jax.pipeline.program_executor` and
  :mod:`~asyncpp_jax.pipeline.executor`), its state and layouts; :mod:`~asyncpp_jax.pipeline.mpmd`:
  the same programs with one compiled program per stage, dispatched from the host.
* ``make_mesh``: the simulate runner's data-parallel mesh (:mod:`~asyncpp_jax.pipeline.mesh`).

Importing the package imports no JAX (``configs`` validates schedules with :mod:`programs`).
"""


def __getattr__(name):
    if name == "make_mesh":  # imported on use: the package itself stays free of JAX
        from asyncpp_jax.pipeline.mesh import make_mesh
        return make_mesh
    raise AttributeError(f"module 'asyncpp_jax.pipeline' has no attribute {name!r}")
