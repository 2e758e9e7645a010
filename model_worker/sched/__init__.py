"""Scheduling: requests, the scheduler, the paged KV cache (block pool, prefix cache by chained block
hashes) and the checks a request passes before it is queued. Pure Python: no torch, no Ray."""
