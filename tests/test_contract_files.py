"""Finding and reading contract files on the client side."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from vaccel.contract.files import ContractFileError, dependency_names, load_contract_files

SPEC = """\
required_features: [{gpu_compute_capability: sm_80}]
dependencies:
  - {name: pytorch, version_range: "2.1.0,2.2.0"}
  - {name: torchvision}
"""


def test_nothing_given_and_nothing_there(tmp_path: Path) -> None:
    files = load_contract_files(None, None, tmp_path)
    assert files.empty and files.packages == () and files.spec_name == ""


def test_defaults_found_in_the_working_directory(tmp_path: Path) -> None:
    (tmp_path / "runtime-spec.yaml").write_text(SPEC)
    (tmp_path / "accelerator-config.yaml").write_text("backend: auto\n")
    files = load_contract_files(None, None, tmp_path)
    assert files.spec_text == SPEC and files.spec_name == "runtime-spec.yaml"
    assert files.config_text == "backend: auto\n"
    assert files.config_name == "accelerator-config.yaml"
    assert files.packages == ("pytorch", "torchvision")


def test_config_runtime_contract_is_relative_to_the_config(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "job-spec.yaml").write_text(SPEC)
    (conf / "accel.yaml").write_text("runtime_contract: ./job-spec.yaml\n")
    (tmp_path / "runtime-spec.yaml").write_text("dependencies: []\n")  # not the one
    files = load_contract_files(None, "conf/accel.yaml", tmp_path)
    assert files.spec_text == SPEC
    assert files.spec_name == os.path.join("conf", "job-spec.yaml")
    # An explicit contract wins over the config's runtime_contract.
    explicit = load_contract_files("runtime-spec.yaml", "conf/accel.yaml", tmp_path)
    assert explicit.spec_text == "dependencies: []\n"


def test_missing_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ContractFileError, match=r"runtime contract nope\.yaml: does not exist"):
        load_contract_files("nope.yaml", None, tmp_path)
    with pytest.raises(ContractFileError, match=r"accelerator config .*: is a directory"):
        load_contract_files(None, tmp_path, tmp_path)
    (tmp_path / "accelerator-config.yaml").write_text("runtime_contract: ../gone.yaml\n")
    with pytest.raises(ContractFileError, match=r"runtime_contract \.\./gone\.yaml not found"):
        load_contract_files(None, None, tmp_path)


def test_binary_file_is_a_clear_error(tmp_path: Path) -> None:
    spec = tmp_path / "runtime-spec.yaml"
    spec.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ContractFileError, match="not UTF-8 text"):
        load_contract_files(spec, None, tmp_path)


def test_dependency_names_are_read_leniently() -> None:
    assert dependency_names(SPEC) == ("pytorch", "torchvision")
    assert dependency_names("dependencies: [") == ()  # the daemon reports the error
    assert dependency_names("dependencies: 5") == ()
    assert dependency_names("") == ()


def test_broken_config_yaml_is_left_to_the_daemon(tmp_path: Path) -> None:
    (tmp_path / "accelerator-config.yaml").write_text("backend: [\n")
    files = load_contract_files(None, None, tmp_path)
    assert files.config_text == "backend: [\n" and files.spec_text == ""
