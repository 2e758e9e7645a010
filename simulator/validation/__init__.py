"""The simulator against the real engine and the real served system, its own costs, a fingerprint of
its results and the plots (docs/simulator.md)."""
