"""Generate the Python gRPC code for proto/vaccel/v1/*.proto into vaccel_common/v1/.

    python scripts/gen_proto.py          # write the files
    python scripts/gen_proto.py --check  # exit 1 when the committed files are stale

The proto package is `vaccel.v1` (its wire names, `/vaccel.v1.Broker/Acquire`, stay), but
the generated modules live in the shared layer `vaccel_common`, which both the daemon and
the client import without importing each other. protoc names the Python import after the
.proto's path, so the one generated import between the modules, and the module name the
classes get, are rewritten to match.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT_PACKAGE = ROOT / "vaccel_common" / "v1"
# protoc writes `from vaccel.v1 import broker_pb2`; the modules import as vaccel_common.v1.
# It also names the classes' module 'vaccel.v1.broker_pb2', where pickle cannot find them.
_REWRITES = ((b"from vaccel.v1 import ", b"from vaccel_common.v1 import "),
             (b", 'vaccel.v1.", b", 'vaccel_common.v1."))
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_descriptor.py")
INIT_TEXT = '''"""Generated gRPC code for the vaccel.v1 API (scripts/gen_proto.py; do not edit)."""

from vaccel_common.proto_loader import preload as _preload

_preload(__name__, ("broker",))  # the message classes without protobuf's Python layer
'''


def generate(out_root: Path) -> list[Path]:
    """Run protoc for every .proto file; return the generated files under out_root/v1."""
    from grpc_tools import protoc  # a dev dependency, only needed to regenerate

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    # protoc writes vaccel/v1/...; out_root plays the part of the folder above `vaccel`.
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    generated = out_root / "vaccel" / "v1"
    files = sorted(p for p in generated.iterdir() if p.name.endswith(GENERATED_SUFFIXES))
    for path in files:
        text = path.read_bytes()
        for protoc_wrote, shared in _REWRITES:
            text = text.replace(protoc_wrote, shared)
        path.write_bytes(text)
    descriptors = [_write_descriptor(path) for path in files if path.name.endswith("_pb2.py")]
    return sorted(files + descriptors)


def _write_descriptor(pb2: Path) -> Path:
    """X_descriptor.py: the serialized .proto file that X_pb2.py adds to protobuf's pool,
    for vaccel_common/proto_loader.py to build the classes from without protobuf's
    Python layer."""
    import ast

    calls = [node for node in ast.walk(ast.parse(pb2.read_text())) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "AddSerializedFile"]
    serialized = calls[0].args[0].value  # type: ignore[attr-defined]
    out = pb2.with_name(pb2.name.replace("_pb2.py", "_descriptor.py"))
    out.write_text(f'"""The serialized {pb2.stem[:-4]}.proto (scripts/gen_proto.py; do not edit)."""\n\n'
                   f"SERIALIZED = {serialized!r}\n")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        stale = [
            p.name
            for p in fresh
            if not (OUT_PACKAGE / p.name).exists() or not filecmp.cmp(p, OUT_PACKAGE / p.name, False)
        ]
        init = OUT_PACKAGE / "__init__.py"
        if not init.exists() or init.read_text() != INIT_TEXT:
            stale.append(init.name)
        if args.check:
            if stale:
                print(f"stale generated code: {', '.join(stale)}; run python scripts/gen_proto.py")
                return 1
            return 0
        OUT_PACKAGE.mkdir(parents=True, exist_ok=True)
        for p in fresh:
            (OUT_PACKAGE / p.name).write_bytes(p.read_bytes())
        (OUT_PACKAGE / "__init__.py").write_text(INIT_TEXT)
        print(f"wrote {len(fresh)} files to {OUT_PACKAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
