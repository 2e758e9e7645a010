"""The Ray Serve application: an OpenAI-compatible HTTP ingress in front of LLMServer replicas.

The classes here are plain Python; `deployments.app` wraps them as Serve deployments.
"""
