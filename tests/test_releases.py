"""Every drop-in's switch-on refuses a trainer release it is not tested on, by name, before it
patches anything (issue 51; gbc_kernels/integrations/releases.py, docs/compatibility.md); the
installed (tested) releases pass the same check."""

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gbc_kernels.integrations import releases  # noqa: E402

UNTESTED = {"trl": "1.13.0", "verl": "0.8.0", "openrlhf": "0.10.4", "skyrl": "0.2.0",
            "areal": "1.1.0"}


def _refused(dist, version):
    return pytest.raises(RuntimeError, match=rf"^{dist} {version}: gbc's drop-in is tested on "
                                             rf"{dist} {releases.TESTED[dist][0]}\.x")


@pytest.mark.parametrize("dist", sorted(releases.TESTED))
def test_check_release(dist):
    """Every patch release of a tested minor passes; the minor before and after are refused."""
    assert set(UNTESTED) == set(releases.TESTED)
    for v in releases.TESTED[dist]:
        assert releases.check_release(dist, f"{v}.7") == f"{v}.7"
        first = releases.OLDEST.get(dist, (f"{v}.0",))[0]
        if releases.minor(first) != v:
            first = f"{v}.0"
        assert releases.check_release(dist, f"{first}+local") == f"{first}+local"
    with _refused(dist, UNTESTED[dist]):
        releases.check_release(dist, UNTESTED[dist])
    major, mid = releases.TESTED[dist][-1].split(".")
    with _refused(dist, f"{major}.{int(mid) + 1}.0"):       # a newer release too
        releases.check_release(dist, f"{major}.{int(mid) + 1}.0")


def test_a_missing_trainer_is_an_import_error(monkeypatch):
    monkeypatch.setitem(releases.TESTED, "gbc_no_such_dist", ("1.0",))
    with pytest.raises(ImportError, match="^gbc_no_such_dist: not installed"):
        releases.check_release("gbc_no_such_dist")


def _switch_on_check(dist):
    """The version check each adapter's switch-on runs, as it runs it (no stand-in)."""
    if dist == "trl":
        from gbc_kernels.integrations.trl import check_trl_version as check
    elif dist == "verl":
        from gbc_kernels.integrations.verl.engine import check_verl_version as check
    elif dist == "openrlhf":
        from gbc_kernels.integrations.openrlhf import check_openrlhf_version as check
    elif dist == "areal":
        from gbc_kernels.integrations.areal import check_areal_version as check
    else:
        from gbc_kernels.integrations.skyrl import check_skyrl_version as check
    return check


@pytest.mark.parametrize("dist", sorted(releases.TESTED))
def test_switch_on_takes_or_refuses_the_installed_release(dist):
    """The installed release: a tested one passes the switch-on's check, any other is refused
    by name (``make compat`` runs this file alone on the matrix's untested releases; the test
    venv holds tested ones)."""
    version = releases.installed(dist)
    if version is None:
        pytest.skip(f"could not import {dist}: not installed")
    check = _switch_on_check(dist)
    try:
        tested = releases.check_release(dist, version) == version
    except RuntimeError:
        tested = False
    if tested:
        assert check() == version
    else:
        with _refused(dist, re.escape(version)):
            check()


def test_trl_trainer_refuses_an_untested_release(monkeypatch):
    import trl

    from gbc_kernels.integrations import trl as gtrl

    assert gtrl.check_trl_version() == trl.__version__
    monkeypatch.setattr(trl, "__version__", UNTESTED["trl"])
    with _refused("trl", UNTESTED["trl"]):       # before anything is built (no model needed)
        gtrl.GBCGRPOTrainer(None, None)


def test_verl_enable_refuses_an_untested_release(monkeypatch):
    import verl

    from gbc_kernels.integrations.verl import engine as ve

    monkeypatch.setattr(verl, "__version__", UNTESTED["verl"])
    with _refused("verl", UNTESTED["verl"]):
        ve.enable()


def test_openrlhf_enable_refuses_an_untested_release(monkeypatch):
    from gbc_kernels.integrations import openrlhf as gorl

    class Actor:                     # enable()'s class argument: OpenRLHF's Actor stands here
        def forward(self):
            pass

    forward = Actor.forward
    monkeypatch.setattr(releases, "installed",
                        lambda d: UNTESTED["openrlhf"] if d == "openrlhf" else None)
    with _refused("openrlhf", UNTESTED["openrlhf"]):
        gorl.enable(actor_cls=Actor, trainer_cls=False, nthr=True)
    assert Actor.forward is forward                    # nothing patched
    assert not gorl._STATE.methods.nthr


def test_skyrl_enable_refuses_an_untested_release(monkeypatch):
    from conftest import _standin

    _standin("skyrl_cpu").load()              # SkyRL's worker modules import on CPU
    import skyrl.backends.skyrl_train.workers.fsdp.fsdp_worker as fw

    from gbc_kernels.integrations import skyrl as gsky
    from gbc_kernels.integrations.skyrl.worker import ENV

    workers = (fw.PolicyWorker, fw.RefWorker)
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(releases, "installed",
                        lambda d: UNTESTED["skyrl"] if d == "skyrl" else None)
    with _refused("skyrl", UNTESTED["skyrl"]):
        gsky.enable(nthr=True)
    assert (fw.PolicyWorker, fw.RefWorker) == workers  # nothing patched
    assert ENV not in os.environ



def test_an_older_patch_that_differs_is_refused_by_name():
    """verl 0.9.0's GSPO differs from 0.9.1's (which gbc follows): 0.9.0 is refused, with the
    reason; 0.9.1 and later patches pass."""
    assert releases.OLDEST["verl"][0] == "0.9.1"
    with pytest.raises(RuntimeError, match=r"^verl 0\.9\.0: gbc's drop-in is tested on verl "
                                           r"0\.9\.x from 0\.9\.1 on \(verl 0\.9\.0's GSPO"):
        releases.check_release("verl", "0.9.0")
    for ok in ("0.9.1", "0.9.2", "0.9.10+local"):
        assert releases.check_release("verl", ok) == ok


def _setup_extras() -> dict:
    """setup.py's ``extras_require``, read from its source (setup() is not run)."""
    import ast

    tree = ast.parse(open(os.path.join(os.path.dirname(__file__), "..", "setup.py")).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py: no extras_require")


@pytest.mark.parametrize("dist", sorted(releases.TESTED))
def test_each_trainer_extra_accepts_exactly_the_tested_releases(dist):
    """``pip install "gbc_kernels[<trainer>]"`` installs what the drop-in's switch-on accepts and
    nothing it refuses (issue 59): the extra's requirement on the trainer has the range
    ``>=`` the oldest tested minor (or :data:`releases.OLDEST`'s patch) ``, <`` the minor after
    the newest tested one, and every release the range takes passes
    :func:`releases.check_release` while those around it are refused."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    reqs = [Requirement(r) for r in _setup_extras()[dist]]
    own = [r for r in reqs if r.name == dist]
    assert len(own) == 1, f"setup.py's {dist!r} extra: expected one requirement on {dist}"
    spec = own[0].specifier
    minors = sorted(releases.TESTED[dist], key=Version)
    low = releases.OLDEST[dist][0] if dist in releases.OLDEST else minors[0]
    major, last = Version(minors[-1]).release[:2]
    assert str(spec) == str(type(spec)(f">={low},<{major}.{last + 1}")), (dist, str(spec))
    # every tested minor's first patches are installable and accepted; the releases around not
    for m in minors:
        for patch in ("0", "1", "7"):
            v = f"{m}.{patch}"
            if Version(v) >= Version(low):
                assert v in spec, (dist, v)
                assert releases.check_release(dist, v) == v
    for outside in (f"{major}.{last + 1}.0", UNTESTED[dist]):
        assert outside not in spec, (dist, outside)
        with pytest.raises(RuntimeError, match=rf"^{dist} {re.escape(outside)}:"):
            releases.check_release(dist, outside)
