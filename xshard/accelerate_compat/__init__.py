"""Accelerate's compatibility surface: what a script written for HF Accelerate reaches besides the Accelerator.

- ``accelerator_surface``: the Accelerator's members a script written for Accelerate reaches besides
  training (Accelerate's properties, process helpers, trackers, ``save_model``), a mixin of
  ``xshard.Accelerator`` typed against ``accelerator_core.AcceleratorCore``.
- ``accelerator_state``: ``accelerator.state`` / ``gradient_state`` and ``DistributedType`` (Accelerate's
  ``accelerate.state``), answered from the job; Accelerate's own ``PartialState`` filled when a
  script imported Accelerate.
- ``utils``: ``accelerate.utils``' names (``set_seed``, ``ProjectConfiguration``, the ``*Kwargs`` and
  plugin classes, ``DataLoaderConfiguration`` ...).
- ``tracking``: ``log_with`` trackers (TensorBoard, W&B, MLflow).
- ``metrics``: ``gather_for_metrics``, ``pad_across_processes``, ``split_between_processes``.
- ``project``: automatic checkpoint naming (``ProjectConfiguration``).
- ``saving``: ``save`` / ``save_model`` in transformers' file layout.
- ``missing``: Accelerate's names xshard lacks, each with xshard's way.

Users keep Accelerate's import paths (``accelerate.X`` -> ``xshard.X``): the thin top-level modules
``IMPORT_PATHS`` lists, the one list of them, re-export these (``tests/test_tree.py``). Only the user API
(``xshard.Accelerator``, the package root, the Trainer) imports this package; the job machinery
(``job``, ``prepared``, ``data``, ``checkpoint``, ``config``, ``sharding``) never does
(``tests/test_import_graph.py``).

Imports nothing: ``import xshard`` stays light when it reads ``missing``.
"""

#: Accelerate's import paths that xshard keeps, each a thin top-level module re-exporting the module named here
IMPORT_PATHS: dict[str, str] = {
    "xshard.state": "xshard.accelerate_compat.accelerator_state",
    "xshard.utils": "xshard.accelerate_compat.utils",
    "xshard.tracking": "xshard.accelerate_compat.tracking",
    "xshard.metrics": "xshard.accelerate_compat.metrics",
    "xshard.logging": "xshard.runtime.rank_logging",
}
