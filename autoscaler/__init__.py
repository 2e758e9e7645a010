"""Scaling on what users feel: queue length and TTFT; admission control at the ingress."""
