"""The top floor: iterserve's command line (`iterserve serve | bench | demo | generate`).

It imports every other package (model_worker, deployments, loadtest); nothing imports it. The
layers below it import nothing above them (tests/unit/test_layering.py checks).
"""
