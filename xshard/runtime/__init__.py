"""The job machinery: what runs between the user API (``xshard.Accelerator``, the Trainer) and the sharded core.

One module per job, none of them imported by the core (``xshard.sharding``) or the device layer:

- ``job``: ``JobState``, where the job runs (asked of the backend's world), what it prepared, its step counters
  and the accumulation window;
- ``mixed_precision``: ``Precision``, the one owner of autocast, backward, unscaling, clipping and the optimizer
  step (the straight chain of one step);
- ``prepared``: the optimizer and LR scheduler ``prepare`` hands back (the optimizer gates on the accumulation
  window and asks the precision owner to step);
- ``data``: loaders sharded per rank, device placement, mid-epoch resume; ``batch_order``: which batches of a
  map-style loader each rank reads; ``stream_shard``: how a stream is split; ``stream_position``: a stateful
  stream's own position, kept per rank; ``iterator_seed``: the RNG draw each pass over a loader starts with,
  replayed on resume; ``loader_job``: what a prepared loader asks of its job (``LoaderAgreement``,
  ``PassOrder``); ``loader_surface``: Accelerate's members of a prepared loader;
- ``grads``: clipping inside an accumulation window, as Accelerate does it;
- ``rebind``: optimizers built before ``prepare`` follow the Parameters the core replaced;
- ``rank_logging``: per-rank log levels and the main process's progress bars;
- ``launch_marker``: how ``xshard launch`` learns that its job built an xshard Accelerator;
- ``compile``: a prepared model compiled as Accelerate compiles one (``TorchDynamoPlugin``, ``--torch_compile``);
- ``throughput`` and ``device_peak``: the throughput reports and the device's peak FLOPS they divide by.

Accelerate's import paths (``xshard.state``, ``xshard.utils`` ...) are in ``xshard.accelerate_compat``; the
checkpoint code in ``xshard.checkpoint``; the config in ``xshard.config``.
"""
