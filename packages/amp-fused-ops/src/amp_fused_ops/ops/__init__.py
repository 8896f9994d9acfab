"""The op machinery of amp-fused-ops: the op registry and what calls the ops.

- ``_registry``: the registry of the ``amp_C`` ops (schema, reference, fake kernel,
  preconditions and autocast rule of every op) and the dispatcher ops defined from it;
- ``_kernel_ops``: the same for the norm and SyncBN ops;
- ``_autocast``: the autocast kernels that the entries' rules make;
- ``_schema_calls``: those ops called with their schemas' own arguments
  (``multi_tensor_op``, what the fused optimizers call), on tensors or DTensor shards;
- ``_apex_convention``: those ops called as Apex's ``amp_C`` calls them (tensor lists, Python
  numbers, DTensor shards), and the ops of a loaded extension so wrapped;
- ``_reference_mode``: ``use_reference()`` and the other overrides of the ops' kernels at the
  dispatcher;
- ``_preconditions``: the checks of ``chunk_size`` and the scalar arguments;
- ``_multi_tensor_apply``: ``multi_tensor_applier`` (Apex's ``apex.multi_tensor_apply``);
- ``_flatten``: ``flatten`` / ``unflatten`` for bucketing (Apex's ``apex_C``);
- ``_step_plans``: a param group's tensor lists held by the compiled kernels across steps
  (``StepPlanLists``), so that a step passes no lists;
- ``_capture``: whether the work being issued is captured into a (CUDA or emulated) graph;

The public names are re-exported by :mod:`amp_fused_ops` and :mod:`amp_fused_ops.amp_C`.
"""
