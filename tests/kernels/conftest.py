"""Kernel tests run the Triton kernels on CPU tensors through the Triton interpreter.

TRITON_INTERPRET is read when a function is decorated with @triton.jit, so it must be
set before triton is first imported; tests/conftest.py sets it before anything else.
"""
