"""How an engine process is started and tuned: child interpreters and their lifelines
(``child_process``), CPU threads, malloc and the garbage collector of serving processes. A leaf:
it imports nothing from the rest of the engine.
"""
