"""The Triton (GPU) backend: kernels.py (raw kernels), launch.py (launchers and the Backend),
aot.py is ``python -m gbc_kernels.aot``. Importing this package imports triton."""
