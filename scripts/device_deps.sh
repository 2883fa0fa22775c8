#!/usr/bin/env bash
# Prepare what a bare GPU machine needs to run scripts/device_check.sh, in .device-deps/
# (git-ignored; the device tool carries it with carry: [".device-deps"]):
#   .device-deps/debs/    Debian packages of Eigen 3.4, doctest and Google Benchmark (+ its
#                         runtime library), downloaded with `apt-get download` - never unpacked
#                         here; device_check.sh unpacks them into .device-deps/root on the device
#   .device-deps/shared/  the real model and the text (../shared does not travel)
# Then, on the device: scripts/device_check.sh (it finds .device-deps by itself).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
D="$ROOT/.device-deps"
SHARED="${KVEVICT_SHARED_DIR:-$ROOT/../shared}"
rm -rf "$D" && mkdir -p "$D/debs" "$D/shared/models" "$D/shared/data/text"
(cd "$D/debs" && apt-get download libeigen3-dev doctest-dev libbenchmark-dev \
    "$(dpkg -S "$(readlink -f /usr/lib/x86_64-linux-gnu/libbenchmark.so)" 2>/dev/null | cut -d: -f1 || echo libbenchmark1debian)")
if [ -d "$SHARED/models/stories260K" ]; then
  cp -r "$SHARED/models/stories260K" "$D/shared/models/"
  cp "$SHARED/data/text/sherlock.txt" "$D/shared/data/text/"
else
  echo "device_deps: $SHARED/models/stories260K not found; the real-model checks will skip" >&2
fi
du -sh "$D"
