#!/usr/bin/env bash
# The Debian packages the tests run: systemd (systemd-analyze verify), prometheus (the server and promtool)
# and numactl (the pinning tests start workers under it, as production does). Idempotent: installs only what is missing; needs root for apt-get.
#   bash deploy/install-test-deps.sh
set -euo pipefail

declare -A tool_package=([systemd-analyze]=systemd [promtool]=prometheus [prometheus]=prometheus [numactl]=numactl)
missing=()
for tool in "${!tool_package[@]}"; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        missing+=("${tool_package[$tool]}")
    fi
done
if [ ${#missing[@]} -eq 0 ]; then
    echo "install-test-deps: systemd-analyze, promtool, prometheus and numactl are present"
    exit 0
fi
packages=$(printf '%s\n' "${missing[@]}" | sort -u | tr '\n' ' ')
if [ "$(id -u)" -ne 0 ]; then
    echo "install-test-deps: missing Debian packages: ${packages}; run this script as root" \
         "(sudo bash $0), or: sudo apt-get install -y ${packages}" >&2
    exit 1
fi
echo "install-test-deps: installing ${packages}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# shellcheck disable=SC2086  # one word per package
apt-get install -y -qq --no-install-recommends ${packages}
# Debian's postinst may start a prometheus service where an init system runs; the tests start
# their own server on free loopback ports and do not need it.
