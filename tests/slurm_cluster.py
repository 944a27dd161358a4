"""The real single-node Slurm (bench/testbeds/slurm.py) as a pytest fixture: one cluster per
test module that asks for `slurm`. The cluster itself lives in bench/testbeds so that the
benchmarks use it without pytest."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from bench.testbeds.slurm import SlurmCluster, SlurmStartError, missing_programs

__all__ = ["SlurmCluster", "SlurmStartError", "install_or_skip", "missing_programs", "slurm_fixture"]


def install_or_skip() -> None:
    """Install slurm-wlm when it is missing and we are root; skip loudly otherwise."""
    missing = missing_programs()
    if not missing:
        return
    if os.getuid() != 0:
        pytest.skip(f"SLURM TESTS SKIPPED: {', '.join(missing)} missing and not root to install slurm-wlm "
                    "(run scripts/setup.sh as root)")
    r = subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "slurm-wlm"],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    assert r.returncode == 0 and not missing_programs(), f"cannot install slurm-wlm:\n{r.stdout}\n{r.stderr}"


@pytest.fixture(scope="module", name="slurm")
def slurm_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """One running cluster per test module: `from tests.slurm_cluster import slurm_fixture`
    there, and ask for `slurm`."""
    install_or_skip()
    if os.getuid() != 0:
        pytest.skip("SLURM TESTS SKIPPED: the test cluster needs root (device nodes, the munge user)")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except SlurmStartError as err:
        pytest.fail(f"the test Slurm did not start: {err}")
    yield cluster
    cluster.stop()
