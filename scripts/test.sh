#!/usr/bin/env bash
# Everything the tests need on a fresh machine, then the tests.
#   bash scripts/test.sh [pytest args...]
# Creates .venv (reused when present), installs txmq with its test and spark
# extras, a JRE for Spark when java is missing, and the stock JavaScript client
# (ali-ons) the integration tests drive; then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${TXMQ_VENV:-.venv}
step() { printf '\n== %s\n' "$*"; }

step "python environment ($venv)"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e '.[test,spark]'

apt_install() {
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@"
  else
    echo "missing $*: install it (e.g. sudo apt-get install $*)" >&2
  fi
}

step "java for Spark"
command -v java >/dev/null || apt_install default-jre-headless
java -version 2>&1 | head -1 || true

step "node and ali-ons for the stock-client tests"
command -v npm >/dev/null || apt_install nodejs npm
if [ -f tests/integration/js/package.json ] && command -v npm >/dev/null; then
  (cd tests/integration/js && npm ci --no-audit --no-fund --loglevel=error)
fi

step "libfaketime for the retention tests (a broker process that lives 80 hours in the past)"
command -v faketime >/dev/null || apt_install faketime

step "prometheus and promtool for the dashboard and alert-rule tests (a real Prometheus scrapes a broker)"
command -v promtool >/dev/null && command -v prometheus >/dev/null || apt_install prometheus

step "tests"
set +e
"$venv/bin/python" -m pytest "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
