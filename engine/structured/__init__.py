"""Structured output's engine side: xgrammar matchers and token masks (``grammar``), built from a
request's ``Constraint`` (``kvserve.engine.constraints``, torch-free, part of the vocabulary that
``SamplingParams.validate`` checks). The core's engine loop drives it.
"""
