# Shared by scripts/serve and scripts/test: a project virtualenv and the system packages.
VENV="${SANDLOT_VENV:-$PWD/.venv}"
PYTHON="${PYTHON:-python3}"

ensure_system_packages() {
  local missing=()
  command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
  command -v cc >/dev/null 2>&1 || missing+=(gcc libc6-dev)
  [ -e /usr/include/seccomp.h ] || missing+=(libseccomp-dev)
  # mkfs.ext4 formats the sandboxes' size-limited disks (often outside a user's PATH).
  command -v mkfs.ext4 >/dev/null 2>&1 || [ -x /usr/sbin/mkfs.ext4 ] || [ -x /sbin/mkfs.ext4 ] \
    || missing+=(e2fsprogs)
  # The load balancer in front of broker replicas in tests/broker/test_load_balancer.py.
  command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || missing+=(haproxy)
  # Network namespaces for the multi-host run (tests/netns.py, tests/multihost.py).
  command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || [ -x /sbin/ip ] || missing+=(iproute2)
  command -v nsenter >/dev/null 2>&1 || missing+=(util-linux)
  # The workspace page's toolchain (frontend/), for the gate that rebuilds it.
  command -v node >/dev/null 2>&1 || missing+=(nodejs)
  command -v npm >/dev/null 2>&1 || missing+=(npm)
  # The browser the page's tests drive (Playwright's own download is not used).
  [ -x /usr/bin/chromium ] || missing+=(chromium)
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing system packages: ${missing[*]}" >&2
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "missing system packages: ${missing[*]} — install them with: sudo apt-get install -y ${missing[*]}" >&2
    return 1
  fi
}

ensure_venv() {
  local extra="$1"
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
  fi
  # The install builds the C code too (setup.py): a changed source means a new build.
  local inputs
  inputs="$(sha1sum pyproject.toml setup.py src/sandlot/runtime/*.c src/sandlot/dataplane/services/*.c)"
  local stamp="$VENV/.sandlot-$extra-$(sha1sum <<<"$inputs" | cut -c1-12)"
  # An editable build's artifacts live in src/: rebuild if a clean removed them.
  if [ ! -e "$stamp" ] || [ ! -e src/sandlot/runtime/build-manifest.json ] \
    || [ ! -e src/sandlot/dataplane/services/build-manifest.json ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    "$VENV/bin/python" -m pip install -q -e ".[$extra]"
    touch "$stamp"
  fi
}

# The LangGraph server the integration tests start (``langgraph dev``) lives in a virtualenv
# of its own: langgraph-api pins versions (jsonschema-rs) the rest of the suite cannot share.
LANGGRAPH_VENV="${SANDLOT_LANGGRAPH_VENV:-$PWD/.venv-langgraph}"
LANGGRAPH_SERVER="langgraph-cli[inmem]>=0.4.40,<0.5"

ensure_langgraph_venv() {
  if [ ! -x "$LANGGRAPH_VENV/bin/python" ]; then
    "$PYTHON" -m venv "$LANGGRAPH_VENV"
  fi
  local inputs
  inputs="$(sha1sum pyproject.toml setup.py; echo "$LANGGRAPH_SERVER")"
  local stamp="$LANGGRAPH_VENV/.sandlot-langgraph-$(sha1sum <<<"$inputs" | cut -c1-12)"
  if [ ! -e "$stamp" ]; then
    echo "installing the LangGraph server for the integration tests into $LANGGRAPH_VENV" >&2
    "$LANGGRAPH_VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    "$LANGGRAPH_VENV/bin/python" -m pip install -q -e ".[langgraph,deepagents,mcp]" "$LANGGRAPH_SERVER"
    touch "$stamp"
  fi
}

# The workspace page: its sources type-check and lint, and they build exactly the bundle
# committed in src/sandlot/web/static/ (so serving needs no Node, and CI proves the bundle
# is what the sources make).
frontend_check() {
  local built
  built="$(mktemp -d)"
  (
    cd frontend \
      && npm ci --no-audit --no-fund --loglevel=error \
      && npx --no-install tsc --noEmit \
      && npx --no-install eslint . \
      && node build.mjs "$built"
  ) || { rm -rf "$built"; return 1; }
  if ! diff -r "$built" src/sandlot/web/static >/dev/null; then
    echo "src/sandlot/web/static/ is not what frontend/ builds: run (cd frontend && npm run build)" >&2
    diff -rq "$built" src/sandlot/web/static >&2
    rm -rf "$built"
    return 1
  fi
  rm -rf "$built"
}
