#!/usr/bin/env bash
# Regenerates the gRPC stubs from splitserve/protocol/grpc_service.proto. The generated
# files are committed, so running the server needs grpcio and protobuf but not grpcio-tools.
# The exact command (from the repository root):
#
#   .venv/bin/python -m grpc_tools.protoc -I splitserve/protocol \
#       --python_out=splitserve/protocol/_generated --pyi_out=splitserve/protocol/_generated \
#       --grpc_python_out=splitserve/protocol/_generated splitserve/protocol/grpc_service.proto
#
# then the stub's top-level `import grpc_service_pb2` is made package-relative. The stubs
# check their versions at import: they need protobuf >= the gencode version written in
# grpc_service_pb2.py and grpcio >= GRPC_GENERATED_VERSION in grpc_service_pb2_grpc.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=splitserve/protocol/_generated
mkdir -p "$OUT"
"$PY" -m grpc_tools.protoc -I splitserve/protocol \
    --python_out="$OUT" --pyi_out="$OUT" \
    --grpc_python_out="$OUT" splitserve/protocol/grpc_service.proto
sed -i 's/^import grpc_service_pb2 as /from . import grpc_service_pb2 as /' "$OUT/grpc_service_pb2_grpc.py"
if grep -q '^import grpc_service_pb2' "$OUT/grpc_service_pb2_grpc.py"; then
  echo "gen_grpc.sh: could not make the stub's import package-relative" >&2
  exit 1
fi
"$PY" -c "from splitserve.protocol._generated import grpc_service_pb2, grpc_service_pb2_grpc"
echo "generated $OUT/grpc_service_pb2.py, grpc_service_pb2.pyi, grpc_service_pb2_grpc.py"
