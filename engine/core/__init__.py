"""The engine core: the loop that turns requests into steps (``LLMEngine``), its control plane
(``Scheduler``, ``BlockManager``: plain Python, no torch), the core process the server starts
(``core_process``) and the messages it exchanges with the front-end (``ipc``).

Imports the shared vocabulary at ``kvserve.engine``'s top, ``tokenizer/``, ``structured/``,
``model_loader/``, ``executor/`` and ``layers.sampler``; imported by ``frontend/`` (ipc only),
``kvserve.engine.llm`` and the benchmarks.
"""
