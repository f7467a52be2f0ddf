"""The PagedAttention op set: compiled kernels (CPU C++ / CUDA) with a pure-torch reference.

Use the functions in :mod:`cuda_ext.ops`; nothing else in the project touches ``torch.ops``.

Layout::

    csrc/bindings.cpp      TORCH_LIBRARY(paged_serve): each schema once; CPU, CUDA, Meta impls
    csrc/cpu/*.cpp         CPU kernels (at::parallel_for over (sequence, KV head))
    csrc/cuda/*.cu         CUDA kernels, plain CUDA C++ behind csrc/cuda/kernels.h (no torch)
    build.py               JIT build with a persistent cache (see its docstring)
    ops.py                 the public functions; picks and logs the backend
    reference.py           pure-torch version of every op (tests compare against it)

Environment: ``PAGED_SERVE_OPS=auto|compiled|reference`` (default ``auto``: compiled, falling
back to the reference with a warning), ``PAGED_SERVE_EXT_CACHE`` (build cache directory),
``PAGED_SERVE_BUILD_VERBOSE=1``, ``MAX_JOBS`` (parallel compiler jobs).
"""
