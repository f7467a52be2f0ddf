"""The PagedAttention op set: compiled kernels (CPU C++ / CUDA) with a pure-torch reference.

Use the functions in :mod:`cuda_ext.ops`; nothing else in the project touches ``torch.ops``.
"""
