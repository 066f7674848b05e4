"""Accelerate's compatibility surface: what a script written for HF Accelerate reaches besides the Accelerator.

- ``state``: ``accelerator.state`` / ``gradient_state`` and ``DistributedType`` (Accelerate's
  ``accelerate.state``), answered from the job; Accelerate's own ``PartialState`` filled when a
  script imported Accelerate.
- ``utils``: ``accelerate.utils``' names (``set_seed``, ``ProjectConfiguration``, the ``*Kwargs`` and
  plugin classes, ``DataLoaderConfiguration`` ...).
- ``tracking``: ``log_with`` trackers (TensorBoard, W&B, MLflow).
- ``metrics``: ``gather_for_metrics``, ``pad_across_processes``, ``split_between_processes``.
- ``project``: automatic checkpoint naming (``ProjectConfiguration``).
- ``saving``: ``save`` / ``save_model`` in transformers' file layout.
- ``missing``: Accelerate's names xshard lacks, each with xshard's way.

Users keep Accelerate's import paths: ``xshard.state``, ``xshard.utils``, ``xshard.logging``,
``xshard.tracking`` and ``xshard.metrics`` are thin modules that re-export these. Only the user API
(``xshard.Accelerator``, the package root, the Trainer) imports this package; the job machinery
(``job``, ``prepared``, ``data``, ``checkpoint``, ``config``, ``sharding``) never does
(``tests/test_import_graph.py``).

Imports nothing: ``import xshard`` stays light when it reads ``missing``.
"""
