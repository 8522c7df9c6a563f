#!/usr/bin/env bash
# Builds Probity's container image without a registry: a minimal root filesystem from
# Debian's packages (mmdebstrap), the probity binary and the shipped policies, assembled
# into an OCI image layout with umoci and archived as one tar for `ctr images import`,
# `podman load` or `skopeo copy oci-archive:`. packaging/image/Containerfile builds the
# same image with docker or podman; hooks/cli/tests/cli/image.rs checks that the two agree
# and runs the archive's root filesystem.
#
#   scripts/build-image.sh [--binary PATH] [--out DIR] [--refresh]
#
#   --binary PATH  the probity binary to package (default
#                  ${CARGO_TARGET_DIR:-target}/release/probity); its debug information
#                  is stripped in the image, its symbols kept (backtraces name functions)
#   --out DIR      where the archive and the unpacked root filesystem go (default
#                  target/image)
#   --refresh      rebuild the cached Debian root filesystem (to pick up the mirror's
#                  security updates; the cache is otherwise kept until this script's
#                  recipe or package lists change)
#
# Environment: PROBITY_IMAGE_CACHE (default /var/cache/probity/image),
# DEBIAN_MIRROR (default http://deb.debian.org/debian) and DEBIAN_SECURITY_MIRROR
# (default http://deb.debian.org/debian-security).
#
# Writes, in --out (and prints the archive's path on its last line):
#   <repository>-<tag>.oci.tar  the OCI image layout (ref name <tag>), one gzip layer
#   rootfs/                     the root filesystem that layer holds, for inspection
# and, in the cache, <key>/packages.txt: the Debian packages and versions in the image.
#
# The name and tag are the chart's (hooks/chart/probity: values.yaml image.repository,
# and image.tag or else Chart.yaml appVersion), read here so that they cannot drift from
# what the manifests pull. Runs as root on Debian 12 with mmdebstrap and umoci
# (scripts/setup.sh): mmdebstrap's root mode, files owned by the image's user, and a
# chroot that proves the packaged binary runs inside the image before it is archived.
# The only network it uses is the Debian mirror, on a cold cache.
set -euo pipefail

# Debian release of the root filesystem: the release the Containerfile's
# debian:bookworm-slim is, and the one this script's hosts run.
suite=bookworm
# Installed with their dependencies (unpacked, no maintainer script runs: nothing in the
# image may need one). libc6 and libgcc-s1: what the probity binary links (`ldd`).
# nftables and iptables: what the node agent runs (`nft -j list ruleset`,
# iptables-save and ip6tables-save; `nft -f` for an enforced baseline). netbase:
# /etc/protocols and /etc/services, which iptables resolves names through.
packages=(libc6 libgcc-s1 nftables iptables netbase)
# Data only, unpacked without their dependencies, which serve only their maintainer
# scripts (awk for base-files; openssl, debconf and perl for update-ca-certificates):
# base-files for /etc/os-release (what scanners identify the image by) and the licence
# texts the copyright files point to; ca-certificates for the system trust store, which
# this script bundles the way update-ca-certificates would.
data_only=(base-files ca-certificates)
# The image's user: non-root, the uid and gid the chart's webhook and controller run as
# (runAsUser 65532, fsGroup 65532), named like the deb package's system user.
uid=65532
gid=65532
user=probity

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
self="$repo/scripts/build-image.sh"

die() {
  echo "build-image: $*" >&2
  exit 1
}

# mmdebstrap's extract hook (this script calls itself): runs after mmdebstrap unpacked
# the packages and their dependencies, while the downloaded .debs are still in the
# target's apt cache.
extract_hook() {
  local root=$1
  local debs="$root/var/cache/apt/archives"
  # The data-only packages, fetched through mmdebstrap's own apt configuration (the
  # target's package lists) without their dependencies.
  (cd "$debs" && APT_CONFIG="$MMDEBSTRAP_APT_CONFIG" apt-get download -q \
    -o APT::Sandbox::User=root "${data_only[@]}" >/dev/null)
  for p in "${data_only[@]}"; do
    local deb
    deb="$(find "$debs" -maxdepth 1 -name "${p}_*.deb" -print -quit)"
    [ -n "$deb" ] || die "apt-get download did not fetch $p"
    # Into the merged-/usr tree: base-files ships /bin, /lib and /sbin as directories,
    # which would replace the symlinks into /usr.
    dpkg-deb --fsys-tarfile "$deb" | tar -x --keep-directory-symlink -C "$root"
  done
  # The package inventory, where scanners read an image without dpkg (as distroless
  # images keep it): one control paragraph per package in /var/lib/dpkg/status.d.
  mkdir -p "$root/var/lib/dpkg/status.d"
  for deb in "$debs"/*.deb; do
    local name
    name="$(dpkg-deb --field "$deb" Package)"
    {
      dpkg-deb --field "$deb"
      echo "Status: install ok installed"
    } >"$root/var/lib/dpkg/status.d/$name"
  done
}

# The Debian part of the image, made once per key into the cache; prints nothing.
build_base() {
  local root=$1
  local debian="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
  local security="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
  local include
  include="$(IFS=,; echo "${packages[*]}")"
  # extract: no Essential set (no shell, no dpkg, no apt), only the packages named and
  # what they depend on. The merged-/usr hook makes /bin, /sbin and /lib the symlinks
  # into /usr that every Debian 12 system has.
  # The extract hook is this script again; mmdebstrap runs it under sh, which expands
  # $PROBITY_IMAGE_SELF and the target ($1).
  # shellcheck disable=SC2016
  PROBITY_IMAGE_SELF="$self" mmdebstrap --quiet --mode=root --variant=extract \
    --include="$include" \
    --setup-hook=/usr/share/mmdebstrap/hooks/merged-usr/setup00.sh \
    --extract-hook='bash "$PROBITY_IMAGE_SELF" extract-hook "$1"' \
    "$suite" "$root" \
    "deb $debian $suite main" \
    "deb $debian $suite-updates main" \
    "deb $security $suite-security main" >&2

  # What mmdebstrap leaves for installing, none of which the image uses: apt's and
  # dpkg's state (the merged-/usr hook's dpkg database included; status.d stays), the
  # build host's resolv.conf and hostname (the runtime provides both), device nodes
  # (the runtime makes /dev), and the merged-/usr hook's empty multilib directories.
  rm -rf "$root"/etc/apt "$root"/etc/dpkg "$root"/var/lib/apt "$root"/var/cache/apt \
    "$root"/var/log/apt "$root"/etc/resolv.conf "$root"/etc/hostname "$root"/etc/fstab
  find "$root/var/lib/dpkg" -mindepth 1 -maxdepth 1 ! -name status.d -exec rm -rf {} +
  find "$root/dev" -mindepth 1 -delete
  local d
  for d in lib32 libx32; do
    if [ -d "$root/usr/$d" ] && [ -z "$(ls -A "$root/usr/$d")" ]; then
      rm -f "$root/$d"
      rmdir "$root/usr/$d"
    fi
  done
  # Documentation and translations: nobody reads them in a container. The copyright
  # files stay (the licences of what the image redistributes), and so do the licence
  # texts in /usr/share/common-licenses.
  rm -rf "$root"/usr/share/man "$root"/usr/share/info "$root"/usr/share/locale \
    "$root"/usr/share/lintian
  find "$root/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
  find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
  # glibc's iconv modules (8 MB): nothing in the image converts character sets.
  rm -rf "$root"/usr/lib/*-linux-gnu/gconv

  # What iptables' postinst would have done with update-alternatives: the nf_tables
  # variants under the plain names, Debian 12's default. A node whose rules are in the
  # legacy backend is read through the agent's [firewall] settings pointed at
  # /usr/sbin/iptables-legacy-save and /usr/sbin/ip6tables-legacy-save (also here).
  local t
  for t in iptables ip6tables; do
    ln -sfn "$t-nft" "$root/usr/sbin/$t"
    ln -sfn "$t-nft-save" "$root/usr/sbin/$t-save"
    ln -sfn "$t-nft-restore" "$root/usr/sbin/$t-restore"
  done
  # What update-ca-certificates would have written: every certificate Debian ships
  # enabled by default, in /etc/ca-certificates.conf's order, as one bundle (the file
  # rustls-native-certs and OpenSSL look for).
  mkdir -p "$root/etc/ssl/certs"
  find "$root/usr/share/ca-certificates/mozilla" -name '*.crt' -print0 | sort -z |
    xargs -0 cat >"$root/etc/ssl/certs/ca-certificates.crt"
  chmod 0644 "$root/etc/ssl/certs/ca-certificates.crt"
  # Name resolution by files then DNS (/etc/hosts and resolv.conf come from the runtime);
  # users and groups from the files below.
  printf '%s\n' 'passwd: files' 'group: files' 'shadow: files' 'hosts: files dns' \
    'networks: files' 'protocols: files' 'services: files' 'ethers: files' 'rpc: files' \
    >"$root/etc/nsswitch.conf"
}

if [ "${1:-}" = extract-hook ]; then
  extract_hook "$2"
  exit 0
fi

binary="${CARGO_TARGET_DIR:-$repo/target}/release/probity"
out="$repo/target/image"
refresh=0
while [ $# -gt 0 ]; do
  case "$1" in
    --binary) binary="${2:?--binary needs a path}"; shift 2 ;;
    --out) out="${2:?--out needs a directory}"; shift 2 ;;
    --refresh) refresh=1; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$self" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done

[ "$(id -u)" -eq 0 ] || die "run as root (mmdebstrap's root mode, files owned by uid $uid, chroot)"
for tool in mmdebstrap umoci dpkg-deb strip flock chroot sha256sum; do
  command -v "$tool" >/dev/null 2>&1 || die "$tool is missing: run scripts/setup.sh"
done
[ -x "$binary" ] || die "no probity binary at $binary (cargo build --release -p probity-cli, or --binary)"
binary="$(cd "$(dirname "$binary")" && pwd)/$(basename "$binary")"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

# The chart's image reference: values.yaml's image.repository, and image.tag or else
# Chart.yaml's appVersion (the chart's "probity.image" helper).
chart="$repo/hooks/chart/probity"
image_value() {
  awk -v key="$1:" '/^image:/ { in_image = 1; next } /^[^ #]/ { in_image = 0 }
    in_image && $1 == key { v = $2; gsub(/"/, "", v); print v; exit }' "$chart/values.yaml"
}
repository="$(image_value repository)"
tag="$(image_value tag)"
app_version="$(awk '$1 == "appVersion:" { v = $2; gsub(/"/, "", v); print v; exit }' "$chart/Chart.yaml")"
tag="${tag:-$app_version}"
if [ -z "$repository" ] || [ -z "$tag" ]; then
  die "cannot read image.repository and appVersion from $chart"
fi
# The workspace's version, the chart's appVersion and the binary's own must agree: the
# image's version label is the binary's, its tag the chart's.
crate_version="$(awk '/^\[workspace.package\]/ { p = 1; next } /^\[/ { p = 0 }
  p && $1 == "version" { v = $3; gsub(/"/, "", v); print v; exit }' "$repo/Cargo.toml")"
[ "$crate_version" = "$app_version" ] ||
  die "Cargo.toml's version $crate_version is not Chart.yaml's appVersion $app_version: bump both"
version_line="$("$binary" --version | head -n 1)"
version="$(echo "$version_line" | awk '{ print $2 }')"
[ "$version" = "$crate_version" ] ||
  die "$binary is version $version, the workspace $crate_version: rebuild it"
# The commit the binary was built from, as its --version says (`unknown` outside git).
revision="$(echo "$version_line" | sed -n 's/.*(commit \([^)]*\)).*/\1/p')"
revision="${revision:-unknown}"
source_url="$(awk '/^\[workspace.package\]/ { p = 1; next } /^\[/ { p = 0 }
  p && $1 == "repository" { v = $3; gsub(/"/, "", v); print v; exit }' "$repo/Cargo.toml")"
licenses="$(awk '/^\[workspace.package\]/ { p = 1; next } /^\[/ { p = 0 }
  p && $1 == "license" { v = $3; gsub(/"/, "", v); print v; exit }' "$repo/Cargo.toml")"
case "$(dpkg --print-architecture)" in
  amd64) arch=amd64 ;;
  arm64) arch=arm64 ;;
  *) die "architecture $(dpkg --print-architecture) is not packaged yet" ;;
esac
# The name containerd's CRI looks the chart's reference up by: a bare name is Docker
# Hub's library (probity:0.1.0 is docker.io/library/probity:0.1.0).
case "$repository" in
  */*) first="${repository%%/*}" ;;
  *) first="" ;;
esac
if [ -z "$first" ]; then
  full_name="docker.io/library/$repository:$tag"
elif [[ "$first" == *.* || "$first" == *:* || "$first" == localhost ]]; then
  full_name="$repository:$tag"
else
  full_name="docker.io/$repository:$tag"
fi

# The Debian root filesystem, cached outside the repository under a key made of what
# decides its content: the suite, the package lists, the mirrors and the recipe (the
# functions above, as bash prints them: comments do not count). The packages' versions
# are the mirror's on the day of the first build; --refresh takes today's.
cache="${PROBITY_IMAGE_CACHE:-/var/cache/probity/image}"
key="$suite-$({
  echo "$suite" "${packages[*]}" "${data_only[*]}"
  echo "${DEBIAN_MIRROR:-}" "${DEBIAN_SECURITY_MIRROR:-}"
  declare -f extract_hook build_base
} | sha256sum | cut -c1-16)"
base="$cache/$key"
mkdir -p "$cache"
# One build at a time, and no copy of a key while a --refresh replaces it. A key only
# ever appears whole (a rename of a finished build).
exec 9>"$cache/.lock"
flock 9
if [ "$refresh" = 1 ] && [ -d "$base" ]; then
  rm -rf "$base"
fi
if [ ! -f "$base/complete" ]; then
  echo "build-image: building the $suite root filesystem into $base" >&2
  started=$(date +%s)
  staging="$(mktemp -d "$cache/.building.XXXXXX")"
  trap 'rm -rf "$staging"' EXIT
  mkdir "$staging/rootfs"
  build_base "$staging/rootfs"
  for f in "$staging"/rootfs/var/lib/dpkg/status.d/*; do
    awk '$1 == "Package:" { p = $2 } $1 == "Version:" { v = $2 } END { print p, v }' "$f"
  done >"$staging/packages.txt"
  echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) in $(($(date +%s) - started)) s" >"$staging/complete"
  mv -T "$staging" "$base"
  trap - EXIT
fi
echo "build-image: $suite root filesystem $base ($(cat "$base/complete"))" >&2

# The image's root filesystem: the cached base (copied under the lock, which a
# --refresh elsewhere takes to replace it), then Probity.
rootfs="$out/rootfs"
rm -rf "$rootfs"
cp -a "$base/rootfs" "$rootfs"
flock -u 9
install -D -m 0755 -o 0 -g 0 "$binary" "$rootfs/usr/bin/probity"
strip --strip-debug "$rootfs/usr/bin/probity"
# The shipped policies, read-only for everyone (the chart mounts its own copy at
# /etc/probity/policies; these are the reference set and the default command's).
mkdir -p "$rootfs/usr/share/probity"
cp -r "$repo/policies" "$rootfs/usr/share/probity/policies"
chown -R 0:0 "$rootfs/usr/share/probity"
chmod -R u=rwX,go=rX "$rootfs/usr/share/probity"
# The user, with no password and no shell (the image has none).
printf '%s\n' "root:x:0:0:root:/root:/usr/sbin/nologin" \
  "$user:x:$uid:$gid:Probity policy engine:/var/lib/probity:/usr/sbin/nologin" \
  >"$rootfs/etc/passwd"
printf '%s\n' "root:x:0:" "$user:x:$gid:" >"$rootfs/etc/group"
chmod 0644 "$rootfs/etc/passwd" "$rootfs/etc/group"
# The state directory (only probity reads it: the server refuses one that others can
# write) and the socket directory, as the chart mounts them.
install -d -m 0700 -o "$uid" -g "$gid" "$rootfs/var/lib/probity"
install -d -m 0755 -o "$uid" -g "$gid" "$rootfs/run/probity"
install -d -m 1777 "$rootfs/tmp"
# A binary that cannot run in the image is not packaged.
chroot --userspec="$uid:$gid" "$rootfs" /usr/bin/probity check /usr/share/probity/policies >/dev/null ||
  die "the packaged probity cannot check its policies inside the image"

# The OCI image: one layer holding the root filesystem, then its configuration.
layout="$out/.layout"
rm -rf "$layout"
umoci init --layout "$layout"
umoci new --image "$layout:$tag"
umoci insert --image "$layout:$tag" "$rootfs" /
config_args=(
  --os linux --architecture "$arch"
  --config.user "$uid:$gid"
  --config.entrypoint /usr/bin/probity
  # The default command: the sidecar on its Unix socket, with the image's policies and
  # state directory. Every chart workload gives its own arguments.
  --config.cmd serve --config.cmd --policies=/usr/share/probity/policies
  --config.cmd --state-dir=/var/lib/probity
  --config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
  --config.workingdir /
  --config.label "org.opencontainers.image.title=probity"
  --config.label "org.opencontainers.image.description=Policy, compliance and data-integrity engine for GPU clusters"
  --config.label "org.opencontainers.image.version=$version"
  --config.label "org.opencontainers.image.revision=$revision"
  --config.label "org.opencontainers.image.source=$source_url"
  --config.label "org.opencontainers.image.licenses=$licenses"
  --history.comment "scripts/build-image.sh: Debian $suite ($key), probity $version"
)
umoci config --image "$layout:$tag" "${config_args[@]}"
umoci gc --layout "$layout"
# The full name next to the OCI ref name (which is only the tag): containerd names the
# image by it, so `ctr images import` needs no --base-name to give the CRI the name the
# chart's reference resolves to.
ref_annotation="\"org.opencontainers.image.ref.name\":\"$tag\""
grep -qF "$ref_annotation" "$layout/index.json" || die "umoci wrote no ref name $tag"
sed -i "s|$ref_annotation|\"io.containerd.image.name\":\"$full_name\",$ref_annotation|" \
  "$layout/index.json"
chmod -R go+rX "$layout"
archive="$out/${repository##*/}-$tag.oci.tar"
tar -C "$layout" --sort=name --owner=0 --group=0 --numeric-owner \
  -cf "$archive.tmp" oci-layout index.json blobs
mv "$archive.tmp" "$archive"
rm -rf "$layout"

echo "build-image: $archive ($full_name): $(du -h "$archive" | cut -f1) archived," \
  "$(du -sh "$rootfs" | cut -f1) unpacked" >&2
echo "$archive"
