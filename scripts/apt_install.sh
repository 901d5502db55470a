#!/usr/bin/env bash
# Install Debian packages for the tests (scripts/test.sh calls it with what is missing):
#   scripts/apt_install.sh PACKAGE...
# On a fresh boot unattended-upgrades holds apt's locks for minutes: wait for them (APT_WAIT s, default 600, said
# once), never die at once. DPkg::Lock::Timeout waits on dpkg's lock; the lists lock of `apt-get update` is retried
# here every APT_RETRY_S s (default 5). What apt will do to the machine is said before it does it: the new packages,
# and the installed ones it upgrades on the way (systemd-container pulls the running systemd to its own version:
# 252.38 -> 252.39 on one Debian 12).
set -euo pipefail
[ $# -gt 0 ] || exit 0
APT_WAIT=${APT_WAIT:-600}
APT_RETRY_S=${APT_RETRY_S:-5}
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
say() { echo "== $*" >&2; }

apt_locked() {  # apt_locked CMD...: run it, retrying while another apt/dpkg holds a lock, up to APT_WAIT s
  local end=$(( $(date +%s) + APT_WAIT )) said=0 rc out
  while :; do
    rc=0; out=$("$@" 2>&1) || rc=$?
    if [ "$rc" -eq 0 ] || ! grep -qiE "could not get lock|unable to acquire|unable to lock" <<<"$out"; then
      [ -z "$out" ] || echo "$out" >&2
      return "$rc"
    fi
    # said before the bound is checked: a first try that itself outlasted the bound (a loaded machine) says it too
    [ "$said" = 1 ] || say "another apt or dpkg holds its lock (unattended-upgrades after a boot?): waiting up to $(( APT_WAIT / 60 )) min"
    said=1
    if [ "$(date +%s)" -ge "$end" ]; then
      echo "$out" >&2
      return "$rc"
    fi
    sleep "$APT_RETRY_S"
  done
}

apt_locked $SUDO apt-get -o DPkg::Lock::Timeout="$APT_WAIT" update -qq
plan=$(apt-get install -s --no-install-recommends "$@" 2>/dev/null | awk '/^Inst /{print $2, $3}') || true
say "installing Debian packages: $*"
new=$(awk '$2 !~ /^\[/{print $1}' <<<"$plan" | tr '\n' ' ')
upgraded=$(awk '$2 ~ /^\[/{gsub(/[][]/, "", $2); print $1 " (from " $2 ")"}' <<<"$plan" | tr '\n' ' ')
[ -z "$new" ] || echo "   new: $new" >&2
[ -z "$upgraded" ] || echo "   upgraded on the way: $upgraded" >&2
apt_locked $SUDO env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout="$APT_WAIT" install -y -qq \
  --no-install-recommends "$@"
