"""Fake vendor modules for emulated tests of the device layer (no GPU, NPU or Mac needed).

They stand in for torch_npu / torch.npu, torch.cuda and torch.mps at the boundary the backends
call, record what is asked of them, and return what a real device of that kind would report.
What they prove is how xshard drives a vendor runtime, never that the runtime works: that is
what ``xshard env --check`` on real hardware is for.
"""
