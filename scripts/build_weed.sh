#!/usr/bin/env bash
# Build SeaweedFS's `weed` (the S3-compatible server the tests run) at VERSION
# into OUT, from the Go module proxy's source: its go.mod has replace
# directives, so `go install` refuses it.
set -euo pipefail
version=$1
out=$(realpath -m "$2")
dir=$(go mod download -json "github.com/seaweedfs/seaweedfs@${version}" |
      python3 -c "import json, sys; print(json.load(sys.stdin)['Dir'])")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$dir" "$work/src"
chmod -R u+w "$work/src"
mkdir -p "$(dirname "$out")"
(cd "$work/src" && go build -o "$out" ./weed)
echo "built $out"
