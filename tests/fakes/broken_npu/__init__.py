"""torch_npu packages that fail to import the ways a real one does without CANN.

Put ``broken_npu/exits`` or ``broken_npu/no_cann`` first on sys.path (or PYTHONPATH) to get them.
"""
