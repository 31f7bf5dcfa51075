#!/bin/sh
# The headless browser that tests/http/test_dashboard.py drives: Debian's `chromium` package at /usr/bin/chromium.
# Installs it with apt-get when it is missing (as root, on Debian or Ubuntu); does nothing when it is there already.
set -eu
if [ -x /usr/bin/chromium ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-test-browser.sh: /usr/bin/chromium is missing; install Debian's chromium package" \
         "(as root: apt-get update && apt-get install -y chromium)" >&2
    exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
