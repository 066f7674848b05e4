"""A torch_npu whose native library cannot find CANN's shared libraries."""

raise OSError("libascendcl.so: cannot open shared object file: No such file or directory")
