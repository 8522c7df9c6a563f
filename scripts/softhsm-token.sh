#!/bin/sh
# Creates a throwaway SoftHSM2 token and prints the shell lines that select it.
#
#   eval "$(scripts/softhsm-token.sh)"           # new temp dir, label probity-<pid>
#   eval "$(scripts/softhsm-token.sh DIR LABEL)"
#
# Prints: SOFTHSM2_CONF (config pointing at DIR/tokens), PROBITY_HSM_MODULE,
# PROBITY_HSM_TOKEN and PROBITY_HSM_PIN_FILE (a 0600 file holding the user PIN; the PIN is
# never printed or passed on a command line by probity). Remove DIR when done.
# Needs softhsm2 (apt-get install -y softhsm2 opensc).
set -eu
dir=${1:-$(mktemp -d /tmp/probity-softhsm.XXXXXX)}
label=${2:-probity-$$}
module=${PROBITY_HSM_MODULE:-/usr/lib/softhsm/libsofthsm2.so}
command -v softhsm2-util >/dev/null || { echo "softhsm2-util not found: apt-get install -y softhsm2 opensc" >&2; exit 1; }
mkdir -p "$dir/tokens"
umask 077
printf 'directories.tokendir = %s/tokens\nobjectstore.backend = file\nlog.level = ERROR\n' "$dir" > "$dir/softhsm2.conf"
pin=$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')
so_pin=$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n')
printf '%s\n' "$pin" > "$dir/user.pin"
SOFTHSM2_CONF="$dir/softhsm2.conf" softhsm2-util --init-token --free --label "$label" \
    --so-pin "$so_pin" --pin "$pin" >/dev/null
echo "export SOFTHSM2_CONF='$dir/softhsm2.conf'"
echo "export PROBITY_HSM_MODULE='$module'"
echo "export PROBITY_HSM_TOKEN='$label'"
echo "export PROBITY_HSM_PIN_FILE='$dir/user.pin'"
