"""One Backend class per device family (CPU, CUDA, NPU, MPS, TorchTPU, torch_xla) and the dry run's backend,
with what they share: guarded vendor imports and questions asked of a bound device.

The registry in ``xshard.backends`` names them as ``module:Class`` and imports a family's module only when it is
probed or used, so importing this package imports no family."""
