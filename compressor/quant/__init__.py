"""Quantization algorithms and primitives."""
