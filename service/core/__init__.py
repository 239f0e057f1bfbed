"""The estimator core: the job spec, the estimate and its levels, fitting jobs to GPUs, and
calibration against measured runs. Standard library only (tests/core/test_purity.py).

Other layers import each name from the module that declares it (docs/architecture.md lists
the rooms); a package's `_names` stay inside it (tests/test_architecture.py).
"""
