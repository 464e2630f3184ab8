"""Generate the committed gRPC code in `jengine/v1/` from `proto/jengine/v1/*.proto` (run after editing the proto).

    python scripts/gen_proto.py           # regenerate in place
    python scripts/gen_proto.py --check   # exit 1 if the committed files differ from a fresh generation

`-I proto` makes the import path `jengine.v1.jengine_pb2`, so the modules live inside the installed package and the
stubs import each other as `from jengine.v1 import ...`. Two version pins that grpcio-tools writes are relaxed, so the
committed code does not demand the exact toolchain it was made with (and so the check compares only what the proto
decides):
- protobuf's `ValidateProtobufRuntimeVersion` (gencode ≥ 5.27) refuses any runtime older than the generator, across
  majors; the gencode itself only calls the descriptor-builder API that every protobuf ≥ 5.26 has.
- the stub's `GRPC_GENERATED_VERSION` is the generator's own version; it becomes `MIN_GRPCIO`, the first grpcio whose
  channels accept `_registered_method` and whose asyncio server has `add_registered_method_handlers` (the stubs call
  both), so e.g. the GPU image's grpcio 1.84 loads them.
Both floors were checked by serving and calling the stubs on protobuf 5.26.1 with grpcio 1.64.0.
"""

from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"
PROTOS = ("jengine/v1/jengine.proto",)
PACKAGE_DIR = Path("jengine/v1")  # where the modules land, relative to the output root
MIN_GRPCIO = "1.64.0"
INIT_TEXT = '"""Generated code of the `jengine.v1` wire contract (proto/jengine/v1); made by scripts/gen_proto.py."""\n'

_RUNTIME_IMPORT = re.compile(r"^from google\.protobuf import runtime_version as _runtime_version\n", re.M)
_RUNTIME_CHECK = re.compile(r"^_runtime_version\.ValidateProtobufRuntimeVersion\(\n(?:.*\n)*?\)\n", re.M)
_GENCODE_HEADER = re.compile(r"^# NO CHECKED-IN PROTOBUF GENCODE\n(# source: .*\n)# Protobuf Python Version: .*\n",
                             re.M)
_GRPC_PIN = re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.M)


def generate(out_root: Path) -> list[Path]:
    """Run protoc into `out_root` (the repository root for the committed files); returns the files written."""
    import grpc_tools  # the optional dev tool: imported here so `--help` works without it

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    command = [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}",
               f"--python_out={out_root}", f"--pyi_out={out_root}", f"--grpc_python_out={out_root}", *PROTOS]
    subprocess.run(command, check=True, cwd=REPO)
    package = out_root / PACKAGE_DIR
    (package / "__init__.py").write_text(INIT_TEXT)
    files = sorted(package.glob("*_pb2*.py*")) + [package / "__init__.py"]
    for path in files:
        path.write_text(relax_pins(path.read_text()))
    return files


def relax_pins(text: str) -> str:
    """Drop protobuf's exact-runtime check and set the stub's grpcio floor to MIN_GRPCIO (see the module doc)."""
    text = _GENCODE_HEADER.sub(r"\1# Version pins relaxed by scripts/gen_proto.py: loads on protobuf >= 5.26.\n", text)
    text = _RUNTIME_CHECK.sub("", _RUNTIME_IMPORT.sub("", text))
    return _GRPC_PIN.sub(f"GRPC_GENERATED_VERSION = '{MIN_GRPCIO}'", text)


def stale_files(committed_root: Path = REPO) -> list[str]:
    """Unified diffs of every generated file that differs from what is committed under `committed_root`."""
    with tempfile.TemporaryDirectory() as tmp:
        diffs = []
        for fresh in generate(Path(tmp)):
            relative = fresh.relative_to(tmp)
            committed = committed_root / relative
            old = committed.read_text() if committed.is_file() else ""
            new = fresh.read_text()
            if old != new:
                diffs.append("".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                          f"committed/{relative}", f"fresh/{relative}", n=1)))
        return diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with a fresh generation instead of writing")
    args = parser.parse_args(argv)
    if args.check:
        diffs = stale_files()
        for diff in diffs:
            print(diff[:4000])
        print("generated code is current" if not diffs else f"{len(diffs)} generated file(s) are stale")
        return 1 if diffs else 0
    for path in generate(REPO):
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
