"""tritonmoe's microbenchmark harness: ``python -m bench``."""
