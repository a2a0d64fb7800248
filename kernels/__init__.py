"""Attention and KV-write kernels (Triton) with pure-torch references.

Imports only torch and triton, never engine code (DESIGN.md, dependency direction).
"""
