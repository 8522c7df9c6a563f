#!/usr/bin/env bash
# Installs what Probity's tests and server need on a fresh Debian machine that has only
# the Rust toolchain (run as root). Idempotent: it installs only what is missing.
#
# The real services the tests start themselves (rsyslog, Alertmanager, auditd, sshd,
# etcd, Slurm's slurmctld, slurmd and munged) are installed with a policy-rc.d that
# exits 101, so that installing a package never starts its service: the tests start
# and stop each one by PID on loopback or in a network namespace they create.
set -euo pipefail

packages=(
  softhsm2 opensc                                   # PKCS#11 (the HSM anchor, KEKs)
  nftables iptables iproute2                        # firewall collectors and baseline, netns tests
  rsyslog rsyslog-gnutls rsyslog-relp               # the SIEM the forwarder delivers to
  prometheus-alertmanager                           # alert obligations
  auditd openssh-server sudo                        # elevation after a remote login
  etcd-server etcd-client                           # cluster state, tested against the real server
  protobuf-compiler libprotobuf-dev                 # etcd-client's build runs protoc on etcd's .proto files
  python3-pytest python3-cryptography valgrind pkg-config  # C ABI callers
  slurmctld slurmd slurm-client munge lua-posix     # Slurm: job_submit.lua, Prolog, health, drains
  lintian                                           # the Debian package, checked
  mmdebstrap umoci                                  # a Debian root to install it into; the OCI image
  prometheus                                        # promtool: the alert rules' tests
)
# Go for the cgo caller (and, later, the control plane's builds): the machine's own Go
# (/usr/local/go) when it has one. Debian's golang-go is 1.19 and its /usr/bin/go would
# shadow a newer Go for any PATH that lists /usr/bin first, so it is installed only
# where no Go exists at all.
if [ -x /usr/local/go/bin/go ]; then
  export PATH="/usr/local/go/bin:$PATH"
fi
if ! command -v go >/dev/null 2>&1; then
  packages+=(golang-go)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  # No package may start its service: the tests own every daemon they run.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod 0755 /usr/sbin/policy-rc.d
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! rustup target list --installed | grep -qx wasm32-wasip2; then
  echo "setup: adding the wasm32-wasip2 target" >&2
  rustup target add wasm32-wasip2
fi

# cargo-deb builds the Debian packages (scripts/build-deb.sh), cached outside the
# repository.
bash "$(dirname "$0")/cargo-deb.sh" >/dev/null
