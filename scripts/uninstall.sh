#!/usr/bin/env bash
# Remove what scripts/install.sh installed: the service, the unit, the venv and its files, the config.
#   scripts/uninstall.sh [--prefix /opt/edge-agent] [--purge] [--dry-run]
# --purge also removes the state (/var/lib/edge-agent: reports, bundle store, outbox) and the logs dir.
set -euo pipefail
PREFIX=/opt/edge-agent
PURGE=0
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) PREFIX=$2; shift 2 ;;
    --purge) PURGE=1; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,4p' "$0"; exit 0 ;;
    *) echo "uninstall.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
run() { echo "+ $*"; [ "$DRY" -eq 1 ] || "$@"; }

CONFIG_DIR=/etc/edge-agent
UNIT=/etc/systemd/system/edge-agent.service
# shellcheck disable=SC1091
[ -f "$PREFIX/install.env" ] && . "$PREFIX/install.env"

if systemctl list-unit-files edge-agent.service >/dev/null 2>&1; then
  run systemctl disable --now edge-agent.service || true
fi
run rm -rf "$UNIT" "$UNIT.d"
run systemctl daemon-reload
run systemctl reset-failed edge-agent.service 2>/dev/null || true
run rm -rf "$PREFIX" "$CONFIG_DIR"
if [ "$PURGE" -eq 1 ]; then
  # DynamicUser keeps state under /var/lib/private with a symlink in /var/lib
  run rm -rf /var/lib/edge-agent /var/lib/private/edge-agent /var/log/edge-agent /var/log/private/edge-agent
  # systemd made these for DynamicUser; remove them only when nothing else uses them
  for d in /var/lib/private /var/log/private; do [ -d "$d" ] && run rmdir --ignore-fail-on-non-empty "$d"; done
fi
echo "uninstalled"
