"""The pipeline engine: every schedule is a program, and one executor per placement runs any valid one.

* :mod:`~asyncpp_jax.pipeline.schedules`: the one schedule language.  ``programs`` holds every
  schedule (``sync``, ``1f1b``, ``interleaved``, ``zb-h1``, ``2bw``, ``pipedream``, the forward-only
  eval program) as per-device action lists, with their generators, validator, discrete-event
  simulator and delays (which weight version an action reads, which update its gradient joins: the
  one place the engine's delay lives); ``slot_plan`` compiles a program into lock-step slots and
  buffer entries.  Plain Python and NumPy.
* :mod:`~asyncpp_jax.pipeline.options`: :class:`~asyncpp_jax.pipeline.options.EngineOptions`, what
  the engine is told about a run, built once by the runner.
* :mod:`~asyncpp_jax.pipeline.spmd`: the ``spmd`` placement, one ``shard_map`` over
  ``('data', 'stage')`` scanning the slots (``engine`` is its surface).
* :mod:`~asyncpp_jax.pipeline.mpmd`: the ``mpmd`` placement, one compiled program per stage,
  dispatched by the host in the program's order (``engine`` is its surface).
* Shared by both: :mod:`~asyncpp_jax.pipeline.stage` (what a stage computes),
  :mod:`~asyncpp_jax.pipeline.layout` (the mesh, leaf placement, parameter layout, uneven splits),
  :mod:`~asyncpp_jax.pipeline.collectives`, :mod:`~asyncpp_jax.pipeline.vocab_parallel` (the
  algebra of tables split over ``stage``); :mod:`~asyncpp_jax.pipeline.mesh` is the simulate
  runner's data-parallel mesh (``make_mesh``).

Importing the package imports no JAX (``configs`` validates schedules with ``schedules.programs``).
"""
