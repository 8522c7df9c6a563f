#!/usr/bin/env bash
# Builds the real Kubernetes control plane the tests run against (kube-apiserver,
# kube-scheduler, kube-controller-manager, kubectl) and helm, from their Go modules, once per
# machine. The binaries land in a cache outside the repository, keyed by the release and by
# the wrapper modules' go.sum, so a fresh clone reuses them and a bumped release rebuilds:
#
#   $PROBITY_KUBE_CACHE (default /var/cache/probity/kube)/<key>/bin/
#
# Prints that bin directory on its last line. The first build took 375 s on two cores with
# empty Go caches (516 s beside a cargo build), module downloads included. Its Go build cache
# (about 4 GB) and modules (1.1 GB) live in the staging directory and go with it: the build
# runs once per machine, and a CI machine's disk is shared and sometimes nearly full.
set -euo pipefail
cd "$(dirname "$0")"
if [ -x /usr/local/go/bin/go ]; then
  export PATH="/usr/local/go/bin:$PATH"
fi

kube_release=v1.36.3 # k8s.io/kubernetes in control-plane/go.mod; staging modules v0.36.3
helm_release=v4.3.2  # helm.sh/helm/v4 in helm/go.mod
key="kubernetes-${kube_release}-helm-${helm_release}-$(cat control-plane/go.sum helm/go.sum | sha256sum | cut -c1-12)"
cache="${PROBITY_KUBE_CACHE:-/var/cache/probity/kube}"
out="$cache/$key"

if [ -f "$out/complete" ]; then
  echo "$out/bin"
  exit 0
fi

mkdir -p "$cache"
staging="$(mktemp -d "$cache/.building.XXXXXX")"
trap 'rm -rf "$staging"' EXIT
mkdir -p "$staging/bin"
# The module cache is read-only by default; -modcacherw lets rm remove it.
export GOCACHE="$staging/go-build" GOMODCACHE="$staging/go-mod" GOFLAGS="-modcacherw"
started=$(date +%s)

minor="${kube_release#v1.}"
minor="${minor%%.*}"
# So that the binaries report their release, not v0.0.0-master.
kube_ldflags="-s -w \
  -X k8s.io/component-base/version.gitVersion=${kube_release} \
  -X k8s.io/component-base/version.gitMajor=1 \
  -X k8s.io/component-base/version.gitMinor=${minor} \
  -X k8s.io/component-base/version.gitTreeState=clean \
  -X k8s.io/client-go/pkg/version.gitVersion=${kube_release} \
  -X k8s.io/client-go/pkg/version.gitMajor=1 \
  -X k8s.io/client-go/pkg/version.gitMinor=${minor}"
echo "build-control-plane: building Kubernetes ${kube_release} (first build on a machine: 6 to 9 minutes on 2 cores)" >&2
(cd control-plane && go build -trimpath -ldflags "$kube_ldflags" -o "$staging/bin/" \
  k8s.io/kubernetes/cmd/kube-apiserver \
  k8s.io/kubernetes/cmd/kube-scheduler \
  k8s.io/kubernetes/cmd/kube-controller-manager \
  k8s.io/kubernetes/cmd/kubectl)
echo "build-control-plane: building helm ${helm_release}" >&2
(cd helm && go build -trimpath \
  -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=${helm_release}" \
  -o "$staging/bin/" helm.sh/helm/v4/cmd/helm)

echo "built in $(($(date +%s) - started)) s on $(nproc) cores" > "$staging/complete"
rm -rf "$GOCACHE" "$GOMODCACHE"
# $out appears only whole (a rename of a finished build). Two builds at once: the second to
# finish keeps the first's and drops its own; a build killed midway leaves only its
# .building directory, never a half-filled $out.
if mv -T "$staging" "$out" 2>/dev/null; then
  trap - EXIT
elif [ ! -f "$out/complete" ]; then
  echo "build-control-plane: cannot move the build to $out" >&2
  exit 1
fi
echo "build-control-plane: $(cat "$out/complete")" >&2
echo "$out/bin"
