"""The fault suite: real faults on real replica processes (kill, freeze), cancel storms, a soak and an
HTTP fuzzer, each a command (`python -m loadtest.faults.NAME`); docs/reliability.md has the figures."""
