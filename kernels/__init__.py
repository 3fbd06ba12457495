"""Triton kernels of areal_fast, installed as ``areal_fast.kernels``.

Importing this package does not import Triton; each kernel module does, and the backend
selector (``areal_fast.dispatch``) only imports them when Triton is usable.
"""
