"""Turn a copy of the checkout into the client's own project, for the wheel users install in
their own environments (scripts/build_deb.sh ships it in /usr/share/vaccel/wheels): the same
name and version, the packages `vaccel` and `vaccel_common` only, the `vaccel` command only,
and the dependencies the client imports (grpcio, protobuf, PyYAML) instead of the daemon's.

    python scripts/client_wheel.py COPY_OF_THE_CHECKOUT       (rewrites it in place)
"""

from __future__ import annotations

import re
import shutil
import sys
import tomllib
from pathlib import Path

CLIENT_NEEDS = ("grpcio", "protobuf", "PyYAML")  # what client/vaccel and vaccel_common import


def main() -> int:
    root = Path(sys.argv[1])
    pyproject = root / "pyproject.toml"
    text = pyproject.read_text()
    project = tomllib.loads(text)["project"]
    wanted = [r for r in project["dependencies"] if re.split(r"[<>=!~ \[;]", r, maxsplit=1)[0] in CLIENT_NEEDS]
    assert len(wanted) == len(CLIENT_NEEDS), wanted
    deps = "dependencies = [\n" + "".join(f'    "{r}",\n' for r in wanted) + "]\n"
    text, n = re.subn(r"(?ms)^dependencies = \[\n.*?^\]\n", deps, text, count=1)
    assert n == 1
    text, n = re.subn(r'(?m)^vaccel-brokerd = .*\n', "", text)
    assert n == 1
    text, n = re.subn(r'(?m)^include = \[.*\]$', 'include = ["vaccel", "vaccel.*", "vaccel_common*"]', text)
    assert n == 1
    # The daemon's files: the unit, the example config (the proto stays, for other languages).
    text, n = re.subn(r'(?m)^"share/vaccel/(systemd|examples)" = .*\n', "", text)
    assert n == 2
    pyproject.write_text(text)
    shutil.rmtree(root / "brokerd")
    return 0


if __name__ == "__main__":
    sys.exit(main())
