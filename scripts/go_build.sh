#!/usr/bin/env bash
# Build one command of a Go module, MODULE@VERSION's package PKG, into OUT,
# from the Go module proxy's source:
#   scripts/go_build.sh helm.sh/helm/v3@v3.22.0 ./cmd/helm bin/helm
# Building from the downloaded source works where `go install` refuses a
# module with replace directives (SeaweedFS). The module and build caches are
# private to the build and removed after it (several GB for SeaweedFS).
set -euo pipefail
module=$1
pkg=$2
out=$(realpath -m "$3")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export GOMODCACHE="$work/mod" GOCACHE="$work/cache" GOFLAGS=-modcacherw
dir=$(go mod download -json "$module" |
      python3 -c "import json, sys; print(json.load(sys.stdin)['Dir'])")
cp -r "$dir" "$work/src"
mkdir -p "$(dirname "$out")"
(cd "$work/src" && go build -o "$out" "$pkg")
echo "built $out"
