#!/usr/bin/env bash
# Chromium and its driver for the live panel's browser test (tests/live/test_browser_panel.py),
# from Debian's packages. Quietly does nothing where they are already there, or without root
# and apt-get (the test then skips, saying why).
set -uo pipefail
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null 2>&1; then
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium chromium-driver; } >/tmp/gpufleet-setup-browser.log 2>&1; then
  echo "scripts/setup_browser.sh: could not install chromium (see /tmp/gpufleet-setup-browser.log); the browser test will skip" >&2
fi
exit 0
