"""Kernel tests: each Triton kernel against its torch reference (helpers in kernel_cases.py).

tests/conftest.py switches on triton's interpreter when there is no CUDA.
"""
