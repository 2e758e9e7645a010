"""Prefix-aware request routing across LLMServer replicas: pure policies and a prefix index, and
the Ray Serve RequestRouter that uses them (`router.serve_router`)."""
