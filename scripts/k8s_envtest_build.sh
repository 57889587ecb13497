#!/usr/bin/env bash
# Build (once) and cache a kube-apiserver for the k8s test tier, and install etcd.
#
# No package registry ships a kube-apiserver binary, but Debian bookworm ships the full Kubernetes
# 1.20.2 source (vendor/ included) and etcd-server 3.4. Recipe: /work/shared/k8s-envtest.md, kept
# in prose in tests/k8s/README.md. Idempotent: a cached binary makes this a no-op apart from
# checking that etcd is installed. Runs as root on a fresh Debian bookworm machine (CI).
#
# Output: $RAYZERO_CACHE/kube-apiserver-1.20.2 (default ~/.cache/rayzero). Costs ~5 min of CPU once.
set -euo pipefail

CACHE="${RAYZERO_CACHE:-$HOME/.cache/rayzero}"
BINARY="$CACHE/kube-apiserver-1.20.2"
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive

need_update=1
apt_update() {
    if [ "$need_update" = 1 ]; then $SUDO apt-get update -qq; need_update=0; fi
}

if ! command -v etcd >/dev/null 2>&1 || ! command -v openssl >/dev/null 2>&1; then
    apt_update
    $SUDO apt-get install -y -qq etcd-server openssl >/dev/null
fi

if [ -x "$BINARY" ] && "$BINARY" --version >/dev/null 2>&1; then
    echo "k8s-envtest: cached $BINARY"
    exit 0
fi

mkdir -p "$CACHE"
SRC_LIST=/etc/apt/sources.list.d/rayzero-deb-src.sources
if ! grep -rqs '^Types:.*deb-src' /etc/apt/sources.list.d/ && ! grep -qs '^deb-src' /etc/apt/sources.list 2>/dev/null; then
    # The machine's own bookworm entry (same mirror and keyring), source packages only: the first
    # stanza of debian.sources with its Types changed to deb-src and its Suites cut to bookworm.
    awk 'BEGIN{RS=""; ORS="\n\n"} NR==1 {
            gsub(/Types:[^\n]*/, "Types: deb-src"); gsub(/Suites:[^\n]*/, "Suites: bookworm"); print }' \
        /etc/apt/sources.list.d/debian.sources | $SUDO tee "$SRC_LIST" >/dev/null
    need_update=1
fi
apt_update
$SUDO apt-get install -y -qq golang-go rsync make dpkg-dev openssl golang-github-modern-go-reflect2-dev >/dev/null

WORK="$CACHE/build"
rm -rf "$WORK"
mkdir -p "$WORK"
cd "$WORK"
apt-get source --download-only kubernetes >/dev/null
tar -xzf kubernetes_*.orig.tar.gz
SRC="$(find . -maxdepth 1 -mindepth 1 -type d -name 'kubernetes*' | head -n 1)"
cd "$SRC"

# Go 1.19 with the vendored reflect2 (v1.0.0) builds an apiserver that SIGSEGVs in json-iterator's
# map iteration on the first custom-resource write; Debian's reflect2 1.0.2 fixes that.
rm -rf vendor/github.com/modern-go/reflect2
cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 vendor/github.com/modern-go/reflect2
rm -f vendor/github.com/modern-go/reflect2/go.mod

# GOPATH mode, as Debian's own rules build it.
export GOPATH="$PWD/.go" CGO_ENABLED=0 GO111MODULE=off GOFLAGS=
mkdir -p .go/src/k8s.io
ln -sfn ../../.. .go/src/k8s.io/kubernetes
cd .go/src/k8s.io/kubernetes
make WHAT=cmd/kube-apiserver
install -m 0755 _output/bin/kube-apiserver "$BINARY.tmp"
mv "$BINARY.tmp" "$BINARY"
cd "$CACHE"
rm -rf "$WORK"
echo "k8s-envtest: built $BINARY"
