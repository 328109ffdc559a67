"""Build of gbc_kernels.

The C++ CPU kernels (csrc/) are compiled against the installed PyTorch, so install without
build isolation:  pip install --no-build-isolation -e .
When PyTorch or a C++ compiler is missing at build time the package still installs, without the
extension; ``backend="auto"`` then uses the chunked PyTorch path (and says so once).
"""

import os
import sys
import warnings

from setuptools import find_packages, setup

ext_modules, cmdclass = [], {}
if os.environ.get("GBC_NO_EXTENSION", "0") != "1":
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension

        sources = [os.path.join("csrc", f) for f in sorted(os.listdir("csrc"))
                   if f.endswith(".cpp")]
        if sources:
            ext_modules.append(CppExtension(
                name="gbc_kernels._C",
                sources=sources,
                # -g0: Python's CFLAGS carry -g, and debug info for the torch headers was a
                # third of the compile time; the kernels' code is the same without it
                extra_compile_args=["-O3", "-g0", "-fopenmp", "-ffp-contract=off",
                                    "-fno-trapping-math"],
                extra_link_args=["-fopenmp"],
            ))
            cmdclass["build_ext"] = BuildExtension.with_options(no_python_abi_suffix=False)
    except Exception as exc:  # torch missing in an isolated build environment
        warnings.warn(f"gbc_kernels: building without the C++ CPU kernels ({exc}); "
                      "install with `pip install --no-build-isolation` to get them")


if cmdclass:
    base = cmdclass["build_ext"]

    class OptionalBuildExt(base):
        """Build the extension; on failure, warn and install the pure-Python package."""

        def run(self):
            try:
                super().run()
            except Exception as exc:
                warnings.warn(f"gbc_kernels: the C++ CPU kernels failed to build ({exc}); "
                              "backend='auto' will use the chunked PyTorch path")

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:
                print(f"gbc_kernels: could not build {ext.name}: {exc}", file=sys.stderr)
                warnings.warn(f"gbc_kernels: the C++ CPU kernels failed to build ({exc})")

    cmdclass["build_ext"] = OptionalBuildExt

setup(
    name="gbc_kernels",
    version="0.1.0",
    description="Fused, memory-light GRPO policy-loss kernels with AR, Lopti, NTHR and "
                "critical-token KL",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["gbc_kernels", "gbc_kernels.*"]) +
             find_packages(where="python", include=["gbc_reference", "gbc_reference.*"]),
    package_dir={"gbc_kernels": "gbc_kernels", "gbc_reference": "python/gbc_reference"},
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
    extras_require={
        "triton": ["triton>=3.0"],
        # One extra per trainer: the trainer releases gbc is tested on (docs/compatibility.md,
        # written by `make compat`) and what gbc needs beside them. torch is never pinned here:
        # the trainer's environment keeps its own. Trainers whose own requirements pull GPU-only
        # packages (verl's, OpenRLHF's, SkyRL's, AReaL's) install on a CPU machine only as
        # docs/compatibility.md's "CPU test install" says. Each trainer's range is exactly what
        # gbc_kernels/integrations/releases.py's TESTED accepts and OLDEST refuses (checked by
        # tests/test_releases.py, which reads this dict).
        "trl": ["trl>=1.14,<1.17", "transformers>=4.56.2"],
        # transformers: gbc's verl path is tested on 5.10.4 (verl 0.9.1's own pin, <5.11),
        # 5.23, 5.24 and 5.25 (5.25 kernelizes every from_pretrained model by default, which
        # verl's meta-device init refuses: gbc's FSDP engine builds without hub kernels;
        # docs/compatibility.md, "transformers")
        "verl": ["verl>=0.9.1,<0.10", "transformers<5.26"],
        "openrlhf": ["openrlhf>=0.11,<0.12"],
        "skyrl": ["skyrl>=0.3,<0.5"],
        # gbc_kernels.integrations.areal (docs/areal.md)
        "areal": ["areal>=1.0,<1.1"],
        # gbc_kernels.integrations.megatron (and the verl / SkyRL Megatron workers)
        "megatron": ["megatron-core>=0.16,<0.17", "packaging>=24.2"],
        # what examples/grpo_trainer.py (make demo) and examples/quickstart.py import
        "demo": ["transformers>=4.50", "matplotlib", "tqdm"],
        "examples": ["transformers>=4.50", "matplotlib", "tqdm"],
    },
    # verl imports its plugins in every process; gbc's switches its engine on when
    # GBC_VERL_ENGINE=1 (gbc_kernels/integrations/verl/plugin.py)
    entry_points={"verl.plugins": ["gbc_kernels = gbc_kernels.integrations.verl.plugin"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
