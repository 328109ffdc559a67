"""Drop-ins for trainers and model libraries. Each submodule imports its own dependency;
``import gbc_kernels`` needs none of them."""
