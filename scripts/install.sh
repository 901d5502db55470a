#!/usr/bin/env bash
# Install edge-agent as a systemd service. Idempotent: running it again upgrades the package and the
# unit and keeps an existing config. Every file it writes is recorded for scripts/uninstall.sh.
#
#   scripts/install.sh [--prefix /opt/edge-agent] [--config-dir /etc/edge-agent]
#                      [--wheelhouse DIR] [--no-start] [--dry-run]
#
# --wheelhouse DIR installs Python packages from DIR only (offline devices; `pip download` them elsewhere).
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
PREFIX=/opt/edge-agent
CONFIG_DIR=/etc/edge-agent
UNIT_DIR=/etc/systemd/system
WHEELHOUSE=""
START=1
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) PREFIX=$2; shift 2 ;;
    --config-dir) CONFIG_DIR=$2; shift 2 ;;
    --unit-dir) UNIT_DIR=$2; shift 2 ;;
    --wheelhouse) WHEELHOUSE=$2; shift 2 ;;
    --no-start) START=0; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

run() {  # print, and do unless --dry-run
  echo "+ $*"
  [ "$DRY" -eq 1 ] || "$@"
}
put() {  # put SRC DEST MODE: install a file with @PREFIX@/@CONFIG_DIR@ replaced
  echo "+ install $1 -> $2 (mode $3)"
  [ "$DRY" -eq 1 ] && return 0
  sed -e "s|@PREFIX@|$PREFIX|g" -e "s|@CONFIG_DIR@|$CONFIG_DIR|g" "$1" > "$2.tmp"
  chmod "$3" "$2.tmp"
  mv -f "$2.tmp" "$2"
}

command -v systemctl >/dev/null || { echo "install.sh: systemctl not found: this installs a systemd service" >&2; exit 1; }
PY=${PYTHON:-python3}

run mkdir -p "$PREFIX/share/models" "$CONFIG_DIR" "$UNIT_DIR"
[ -x "$PREFIX/venv/bin/python" ] || run "$PY" -m venv "$PREFIX/venv"
PIP=("$PREFIX/venv/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir)
if [ -n "$WHEELHOUSE" ] && compgen -G "$WHEELHOUSE/edge_agent_onnx-*.whl" >/dev/null; then
  run "${PIP[@]}" --no-index --find-links "$WHEELHOUSE" --upgrade edge-agent-onnx
else
  # build from a copy: the source tree may be read-only (a mount, a package)
  BUILD=$(mktemp -d)
  trap 'rm -rf "$BUILD"' EXIT
  run cp -r "$SRC/agent" "$SRC/pyproject.toml" "$SRC/README.md" "$BUILD/"
  if [ -n "$WHEELHOUSE" ]; then PIP+=(--no-index --find-links "$WHEELHOUSE"); fi
  run "${PIP[@]}" --upgrade "$BUILD"
fi

# the demo bundle and frames: the initial bundle of a fresh install
for d in digits-classifier demo-frames; do
  run rm -rf "$PREFIX/share/models/$d.new"
  run cp -r "$SRC/models/$d" "$PREFIX/share/models/$d.new"
  run rm -rf "$PREFIX/share/models/$d"
  run mv "$PREFIX/share/models/$d.new" "$PREFIX/share/models/$d"
done
run cp "$SRC/README.md" "$PREFIX/README.md"
run chmod -R a+rX "$PREFIX"

if [ -e "$CONFIG_DIR/agent.yaml" ]; then
  echo "= keeping $CONFIG_DIR/agent.yaml (the default is at $PREFIX/share/agent.yaml.default)"
else
  put "$SRC/systemd/agent.yaml" "$CONFIG_DIR/agent.yaml" 0644
fi
put "$SRC/systemd/agent.yaml" "$PREFIX/share/agent.yaml.default" 0644
put "$SRC/systemd/edge-agent.service" "$UNIT_DIR/edge-agent.service" 0644
[ "$DRY" -eq 1 ] || "$PREFIX/venv/bin/edge-agent" config check "$CONFIG_DIR/agent.yaml" >/dev/null

# the record uninstall.sh reads
if [ "$DRY" -eq 0 ]; then
  printf '%s\n' "PREFIX=$PREFIX" "CONFIG_DIR=$CONFIG_DIR" "UNIT=$UNIT_DIR/edge-agent.service" > "$PREFIX/install.env"
fi

run systemctl daemon-reload
if [ "$START" -eq 1 ]; then
  run systemctl enable edge-agent.service
  run systemctl restart edge-agent.service
else
  run systemctl enable edge-agent.service
fi
echo "installed: journalctl -u edge-agent -f   |   systemctl status edge-agent"
