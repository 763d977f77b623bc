"""Structured output: the request-side constraint (``constraints``, torch-free, checked by
``SamplingParams.validate``) and the xgrammar matchers and token masks (``grammar``).
"""
