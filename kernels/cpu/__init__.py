"""The CPU kernels in C: the sources (``csrc/``), their build into one shared library per machine
(``build``), the C interface's constants and struct mirrors (``abi``) and the ctypes bindings the
layers call (``bindings``).
"""
