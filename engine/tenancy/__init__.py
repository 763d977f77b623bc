"""Tenants in the engine: how the scheduler shares the engine between them (shares.py) and the
checks a request passes before it queues (admission.py)."""
