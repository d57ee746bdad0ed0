#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-quantize for `precache bench trace --baselines llama-cpp`.
#
# The llama.cpp tree is the one llama-cpp-python vendors (its sdist comes from PyPI, which this
# machine reaches; GitHub it does not). Nothing of it is committed: it is built under
# $LLAMA_CPP_DIR (default .llama-cpp/, git-ignored). `make test` never needs it.
#
#   make llama-cpp              # or: benchmarks/llama_cpp/install.sh
#   LLAMA_CPP_DIR=/opt/llama benchmarks/llama_cpp/install.sh
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
DEST="${LLAMA_CPP_DIR:-.llama-cpp}"
PY="${PYTHON:-python3}"
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
SRC="$DEST/llama_cpp_python-$VERSION"

if [ ! -d "$SRC" ]; then
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DEST"
  tar -xzf "$DEST/llama_cpp_python-$VERSION.tar.gz" -C "$DEST"
fi
# the converters' own Python needs: gguf-py ships in the tree; numpy, torch and transformers are
# the project's
cmake -S "$SRC/vendor/llama.cpp" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON > "$DEST/cmake.log"
cmake --build "$DEST/build" --target llama-server llama-quantize -j "$(nproc)" > "$DEST/build.log"
ln -sfn "$SRC/vendor/llama.cpp" "$DEST/src"
echo "llama.cpp built: $DEST/build/bin/llama-server, $DEST/build/bin/llama-quantize; converters in $DEST/src"
