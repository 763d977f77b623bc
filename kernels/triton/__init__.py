"""Triton kernels: paged attention (decode and prefill), the KV-cache store and fused MoE. Loaded
on first use through ``kvserve.kernels`` so that a CPU engine never imports Triton.
"""
