"""Mapping tables for models otfload does not build itself: load them with
:func:`otfload.load_params` (or look at the plan with :func:`otfload.plan_params` /
``otfload inspect --mapping MODULE:TABLE --target MODULE:abstract_params``).

* :mod:`otfload.mappings.linen_llama` — a Linen-style Llama: ``[in, out]`` kernels, one scanned
  decoder block (``params.decoder.layers...``), every projection transposed on load;
* :mod:`otfload.mappings.pytree_llama` — an Equinox-style (or any plain-pytree) Llama: HF names
  without ``model.``, ``[out, in]`` weights, a list of layers; no hook at all.

Each module has ``TABLE`` (config field names in its hooks, so one table serves every size) and
``abstract_params(config, mesh)``, the target tree of ``jax.ShapeDtypeStruct`` for a checkpoint's
``config.json``. ``examples/`` has each one's forward pass, checked against transformers in
``tests/mappings``. MaxText's own parameter trees have their tables in :mod:`otfload.maxtext`.
"""
