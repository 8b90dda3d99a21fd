"""GPU checks (`make test-gpu`). A package, so that its conftest.py is imported as gpu.conftest
and does not shadow tests/conftest.py, which other test modules import as `conftest`."""
