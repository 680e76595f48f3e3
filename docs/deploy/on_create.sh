#!/usr/bin/env bash
# HyperPod-style lifecycle script for a GPU node: install NeuralCache, write its config, mount the
# hub's export and return only once the mount answers. Run as root; safe to run again: a mount
# that answers is left alone, a dead or hung one is repaired.
#
# Settings come from flags or environment variables (flags win):
#   --hub HOST:PORT        NEURALCACHE_HUB           required
#   --mountpoint DIR       NEURALCACHE_MOUNTPOINT    [/mnt/neuralcache]
#   --cache-dir DIR        NEURALCACHE_CACHE_DIR     [/opt/dlami/nvme/neuralcache]
#   --cache-size SIZE      NEURALCACHE_CACHE_SIZE    [100G]
#   --metrics-port PORT    NEURALCACHE_METRICS_PORT  [9477; empty: off]
#   --metrics-addr ADDR    NEURALCACHE_METRICS_ADDR  [0.0.0.0, so Prometheus can scrape the node]
#   --config FILE          NEURALCACHE_CONFIG        [/etc/neuralcache/neuralcache.toml]
#   --venv DIR             NEURALCACHE_VENV          [/opt/neuralcache/venv]
#   --package SPEC         NEURALCACHE_PACKAGE       what pip installs: a wheel path or URL, or a
#                                                    checkout; required when VENV lacks neuralcache
#   --upgrade              NEURALCACHE_UPGRADE=1     reinstall the package even if present
#   --init MODE            NEURALCACHE_INIT          [auto]: systemd if it runs the node, else direct
#   --wait SECONDS         NEURALCACHE_WAIT          [120]: how long to wait for the mount
#   --unit-dir DIR         NEURALCACHE_UNIT_DIR      [/etc/systemd/system]: where the unit goes
#
# Installs touch the network only for what is missing: apt-get runs only if fuse3 (or, when the
# package must be built, a build dependency) is not installed; pip runs only if
# VENV/bin/neuralcache does not exist (or with --upgrade). Pointing --venv at an existing
# installation therefore skips both.
set -euo pipefail

hub=${NEURALCACHE_HUB:-}
mountpoint=${NEURALCACHE_MOUNTPOINT:-/mnt/neuralcache}
cache_dir=${NEURALCACHE_CACHE_DIR:-/opt/dlami/nvme/neuralcache}
cache_size=${NEURALCACHE_CACHE_SIZE:-100G}
metrics_port=${NEURALCACHE_METRICS_PORT-9477}
metrics_addr=${NEURALCACHE_METRICS_ADDR:-0.0.0.0}
config=${NEURALCACHE_CONFIG:-/etc/neuralcache/neuralcache.toml}
venv=${NEURALCACHE_VENV:-/opt/neuralcache/venv}
package=${NEURALCACHE_PACKAGE:-}
upgrade=${NEURALCACHE_UPGRADE:-0}
init=${NEURALCACHE_INIT:-auto}
wait_s=${NEURALCACHE_WAIT:-120}
unit_dir=${NEURALCACHE_UNIT_DIR:-/etc/systemd/system}

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
unit="neuralcache-spoke.service"
runtime_packages=(fuse3)
build_packages=(libfuse3-dev pkg-config gcc python3-dev python3-venv)  # pyfuse3 builds from source
stat_timeout=5  # seconds a healthy mount never needs to answer a statfs; longer means hung

say() { echo "on_create: $*"; }
die() { echo "on_create: error: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case $1 in
        --hub) hub=$2; shift 2 ;;
        --mountpoint) mountpoint=$2; shift 2 ;;
        --cache-dir) cache_dir=$2; shift 2 ;;
        --cache-size) cache_size=$2; shift 2 ;;
        --metrics-port) metrics_port=$2; shift 2 ;;
        --metrics-addr) metrics_addr=$2; shift 2 ;;
        --config) config=$2; shift 2 ;;
        --venv) venv=$2; shift 2 ;;
        --package) package=$2; shift 2 ;;
        --upgrade) upgrade=1; shift ;;
        --init) init=$2; shift 2 ;;
        --wait) wait_s=$2; shift 2 ;;
        --unit-dir) unit_dir=$2; shift 2 ;;
        -h|--help) sed -n '2,/^set -e/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done

# /proc/mounts escapes whitespace, the TOML below quotes values verbatim and the unit is
# rendered with sed: keep values free of what any of them would have to escape.
plain='^[^[:space:]"\\#&]+$'
[ -n "$hub" ] || die "no hub: pass --hub HOST:PORT or set NEURALCACHE_HUB"
[[ $hub =~ $plain && $hub =~ :[0-9]+$ ]] || die "hub must be HOST:PORT, got '$hub'"
for path in "$mountpoint" "$cache_dir" "$config" "$venv"; do
    [[ $path == /* && $path =~ $plain ]] ||
        die "paths must be absolute, without spaces or any of \" \\ # &: '$path'"
done
mountpoint=$(realpath -m "$mountpoint")  # /proc/mounts lists the resolved path
[[ -z $metrics_port || $metrics_port =~ ^[0-9]+$ ]] || die "metrics port must be a number"
[[ $cache_size =~ $plain && $metrics_addr =~ $plain ]] || die "bad cache size or metrics address"
case $init in auto|systemd|direct) ;; *) die "--init must be auto, systemd or direct" ;; esac
if [ "$init" = auto ]; then
    if [ -d /run/systemd/system ]; then init=systemd; else init=direct; fi
fi
[ "$(id -u)" = 0 ] || die "run as root (mounting for all users needs it)"

# --- install ---------------------------------------------------------------------------------

missing_packages() {
    local p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
            echo "$p"
    done
}

apt_install() {
    local missing
    mapfile -t missing < <(missing_packages "$@")
    [ "${#missing[@]}" -gt 0 ] || return 0
    command -v apt-get >/dev/null || die "missing packages ${missing[*]} and no apt-get"
    say "installing system packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" </dev/null
}

if command -v dpkg-query >/dev/null; then
    apt_install "${runtime_packages[@]}"
else
    command -v fusermount3 >/dev/null || die "fusermount3 not found: install fuse3"
fi

if [ ! -x "$venv/bin/neuralcache" ] || [ "$upgrade" = 1 ]; then
    # No default: NeuralCache is not on PyPI, and a bare name could install someone else's project.
    [ -n "$package" ] || die "$venv has no neuralcache: pass --package WHEEL|URL|DIR (or set NEURALCACHE_PACKAGE)"
    command -v dpkg-query >/dev/null && apt_install "${build_packages[@]}"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    say "installing $package into $venv"
    "$venv/bin/pip" install -q --upgrade pip
    "$venv/bin/pip" install -q --upgrade "$package"
fi
neuralcache=$venv/bin/neuralcache
[ -x "$neuralcache" ] || die "$neuralcache missing after the install"

# --- config ----------------------------------------------------------------------------------

scratch=$(mktemp)
trap 'rm -f "$scratch"' EXIT
{
    echo "# Written by $(basename "$0"); see docs/deploy/neuralcache.toml for every option."
    echo "[mount]"
    echo "mountpoint = \"$mountpoint\""
    echo "hub = \"$hub\""
    echo "cache_dir = \"$cache_dir\""
    echo "cache_size = \"$cache_size\""
    if [ -n "$metrics_port" ]; then
        echo "metrics_port = $metrics_port"
        echo "metrics_addr = \"$metrics_addr\""
    fi
} >"$scratch"
config_changed=0
if ! cmp -s "$scratch" "$config" 2>/dev/null; then
    mkdir -p "$(dirname "$config")"
    install -m 0644 "$scratch" "$config"
    config_changed=1
    say "wrote $config"
fi

# --- mount -----------------------------------------------------------------------------------

mounted_type() {  # the filesystem type mounted at $mountpoint, if any
    awk -v mp="$mountpoint" '$2 == mp { t = $3 } END { if (t) print t }' /proc/mounts
}

answers() {  # a neuralcache mount is at $mountpoint and its daemon answers in time
    # statfs, not stat: the kernel may answer a stat from its attribute cache, even for a mount
    # whose daemon has died, but always asks the daemon for statfs.
    [ "$(mounted_type)" = fuse.neuralcache ] &&
        timeout "$stat_timeout" stat -f "$mountpoint/" >/dev/null 2>&1
}

daemon_pid() {  # the daemon holding the cache directory's lock, if one does
    local lock=$cache_dir/daemon.lock pid
    [ -f "$lock" ] || return 0
    flock -n "$lock" true && return 0  # nobody holds it: the pid written there is stale
    pid=$(cat "$lock")
    [[ $pid =~ ^[0-9]+$ ]] && echo "$pid"
    return 0
}

clear_broken_mount() {  # the daemon died or hangs: stop it and drop its mount
    local pid i
    pid=$(daemon_pid)
    if [ -n "$pid" ]; then
        say "daemon $pid does not answer; stopping it"
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    if [ -n "$(mounted_type)" ]; then
        say "clearing the dead mount at $mountpoint"
        fusermount3 -u -z "$mountpoint" 2>/dev/null || umount -l "$mountpoint"
    fi
}

start_systemd() {
    sed -e "s#/opt/neuralcache/venv#$venv#g" -e "s#/etc/neuralcache/neuralcache.toml#$config#g" \
        -e "s#^RequiresMountsFor=.*#RequiresMountsFor=$cache_dir#" "$here/$unit" >"$scratch"
    if ! cmp -s "$scratch" "$unit_dir/$unit"; then
        install -m 0644 "$scratch" "$unit_dir/$unit"
        systemctl daemon-reload
    fi
    systemctl enable -q "$unit"
    # Type=notify: this returns once the mount answers (or the start failed).
    systemctl restart "$unit" || die "$unit failed; see journalctl -u $unit"
}

start_direct() {
    clear_broken_mount
    "$neuralcache" --config "$config" mount || die "mount failed; see $cache_dir/neuralcache.log"
}

current=$(mounted_type)
if [ -n "$current" ] && [ "$current" != fuse.neuralcache ]; then
    die "$mountpoint already holds a $current mount"
fi
if answers; then
    say "$mountpoint is mounted and answers; left alone"
    [ "$config_changed" = 0 ] || say "the new config applies from the next restart of the mount"
else
    mkdir -p "$mountpoint" "$cache_dir"
    if [ "$init" = systemd ]; then start_systemd; else start_direct; fi
fi

deadline=$((SECONDS + wait_s))
while ((SECONDS < deadline)); do
    if answers; then
        say "$mountpoint answers (hub $hub)"
        exit 0
    fi
    sleep 0.2
done
die "$mountpoint did not answer within $wait_s s"
