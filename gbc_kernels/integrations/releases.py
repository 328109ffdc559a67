"""The trainer releases each drop-in is tested on, and the check every switch-on runs.

A drop-in replaces or wraps a trainer's classes and functions, which change between releases;
one run on a release it was not tested on could train with a method silently missing. So each
switch-on (TRL's ``GBCGRPOTrainer``, verl's engine, OpenRLHF's, SkyRL's and AReaL's
``enable``) compares the installed release's ``major.minor`` with :data:`TESTED` and refuses
any other by name.
``docs/compatibility.md`` lists what ``make compat`` ran on each release.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
from typing import Iterator, Optional

# distribution name -> the major.minor releases its drop-in is tested on (docs/compatibility.md)
TESTED = {
    "trl": ("1.14", "1.15", "1.16"),
    "verl": ("0.9",),
    "openrlhf": ("0.11",),
    "skyrl": ("0.3", "0.4"),
    "areal": ("1.0",),
}


# distribution name -> (its oldest patch release gbc runs on, why an older patch of that minor is
# refused): a patch release whose behaviour differs from the one gbc's drop-in follows
OLDEST = {
    "verl": ("0.9.1", "verl 0.9.0's GSPO loss (policy_loss.loss_mode=gspo) gives another value "
                      "than 0.9.1's, which gbc's mapping follows: measured by "
                      "tests/test_verl_engine.py in `make compat`'s verl 0.9.0 venv"),
}


def installed(dist: str) -> Optional[str]:
    """The installed version of distribution ``dist``, None when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def minor(version: str) -> str:
    """``"1.16.0"`` -> ``"1.16"`` (a local or pre-release suffix stays with its minor)."""
    return ".".join(str(version).split("+")[0].split(".")[:2])


def check_release(dist: str, version: Optional[str] = None, *, why: str = "",
                  off: str = "") -> str:
    """``version`` (default: the installed one) of ``dist``, refused with a RuntimeError naming
    it and the tested releases unless its ``major.minor`` is in :data:`TESTED`. ``why``: what
    the drop-in replaces (why another release may differ); ``off``: how to run the trainer's own
    step instead."""
    if version is None:
        version = installed(dist)
        if version is None:
            raise ImportError(f"{dist}: not installed (gbc's {dist} drop-in is tested on "
                              f"{_tested(dist)})")
    if minor(version) not in TESTED[dist]:
        raise RuntimeError(f"{dist} {version}: gbc's drop-in is tested on {_tested(dist)}"
                           + (f" ({why})" if why else "")
                           + "; an untested release is refused rather than run"
                           + (f"; {off}" if off else ""))
    if dist in OLDEST and _patch(version) < _patch(OLDEST[dist][0]) \
            and minor(version) == minor(OLDEST[dist][0]):
        raise RuntimeError(f"{dist} {version}: gbc's drop-in is tested on {_tested(dist)} from "
                           f"{OLDEST[dist][0]} on ({OLDEST[dist][1]}); an untested release is "
                           "refused rather than run" + (f"; {off}" if off else ""))
    return version


def _patch(version: str) -> tuple:
    """``"0.9.1rc1+local"`` -> ``(0, 9, 1)``: the numeric release, for ordering patches."""
    import re

    return tuple(int(re.match(r"\d+", p).group()) if re.match(r"\d+", p) else 0
                 for p in str(version).split("+")[0].split(".")[:3])


def _tested(dist: str) -> str:
    return ", ".join(f"{dist} {v}.x" for v in TESTED[dist])


# transformers' switch for its hub kernels (transformers/integrations/hub_kernels.py:65)
HUB_KERNELS_ENV = "USE_HUB_KERNELS"


@contextlib.contextmanager
def no_hub_kernels() -> Iterator[None]:
    """``USE_HUB_KERNELS=NO`` for the duration: a ``from_pretrained`` inside builds the model as
    transformers <= 5.24 did, its own torch modules, nothing kernelized; the variable is put
    back as it was afterwards (unset stays unset).

    transformers 5.25 turned hub kernels on by default: ``from_pretrained``'s ``use_kernels``
    defaults to None, read as True unless ``USE_HUB_KERNELS`` is false
    (transformers/modeling_utils.py:4224, 4415-4423), and every loaded model goes through
    ``set_use_kernels`` -> ``kernelize`` (modeling_utils.py:4495, 3921) on the model's device
    (integrations/hub_kernels.py:513). verl's FSDP engine builds the model under accelerate's
    ``init_empty_weights`` on every rank but 0, a model on ``meta``, which the ``kernels``
    package (0.19.1, the one release transformers 5.25 accepts) refuses:
    ``ValueError: Unsupported device type 'meta'`` (kernels/_internals/layer/kernelize.py:302).
    With the variable false, ``use_kernels`` is False, ``kernelize`` is never called, and the
    model's ``train()`` does not kernelize later either (it does only when ``use_kernels``).
    Nothing else changes: 5.24 never kernelized by default, and on a CPU 5.25's kernel mapping
    (cuda / rocm / xpu entries only) replaces nothing. Releases before 5.25 read the variable
    once, at import, and kernelize nothing by default: there it changes nothing."""
    old = os.environ.get(HUB_KERNELS_ENV)
    os.environ[HUB_KERNELS_ENV] = "NO"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(HUB_KERNELS_ENV, None)
        else:
            os.environ[HUB_KERNELS_ENV] = old
