"""A cluster simulator that runs our own scheduler, router, admission and autoscaling policies,
with only the model forward (a fitted step-time model) and the clock replaced (docs/simulator.md)."""
