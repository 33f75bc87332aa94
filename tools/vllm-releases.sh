#!/usr/bin/env bash
# Fetch (once) the Python modules of each vLLM release in requirements/vllm-releases.txt,
# for the contract tests: the release's wheel, hash-checked, unpacked without its
# dependencies into a folder of its own, keyed by the wheel's sha256 (a changed pin is a
# new folder). The tests put that folder ahead of the venv's vLLM 0.32 in a subprocess;
# the compiled ops are CUDA builds and never run here. Prints the folders.
#   tools/vllm-releases.sh               ensure every pinned release
#   tools/vllm-releases.sh --print-path  the folders only (fetched or not)
# Env: ENCODERPOOL_CACHE (default ~/.cache/encoderpool), VENV (default tools/venv.sh's)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
pins=$root/requirements/vllm-releases.txt
cache=${ENCODERPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/encoderpool}
dest=$cache/vllm-releases
log() { echo "vllm-releases.sh: $*" >&2; }

# One "version sha256" line per pin.
releases() { sed -n -E 's/^vllm==([^ ]+) --hash=sha256:([0-9a-f]{64})$/\1 \2/p' "$pins"; }
folder() { echo "$dest/$1-${2:0:16}"; }
if [ "${1:-}" = "--print-path" ]; then
  releases | while read -r version sha; do folder "$version" "$sha"; done
  exit 0
fi
[ -n "$(releases)" ] || { log "no release pinned in $pins"; exit 1; }

mkdir -p "$dest"
exec 9>"$dest/.lock"
flock 9  # one fetch at a time: a second caller waits, then finds the folders made
V=${VENV:-$("$root/tools/venv.sh")}
work=""
trap 'rm -rf "$work"' EXIT  # a failed fetch leaves nothing half made
while read -r version sha; do
  out=$(folder "$version" "$sha")
  if [ ! -f "$out/.complete" ]; then
    t0=$(date +%s)
    log "fetching vllm $version (a CUDA wheel of 240-340 MB; only its Python modules are used)"
    work=$(mktemp -d "$dest/.fetch.XXXXXX")
    grep -E "^vllm==$version " "$pins" > "$work/req.txt"
    # --require-hashes: pip refuses a wheel whose sha256 is not the pinned one.
    "$V/bin/python" -m pip --disable-pip-version-check --no-input -q download \
      --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
      --require-hashes -r "$work/req.txt" -d "$work/wheel"
    wheel=$(ls "$work"/wheel/vllm-"$version"-*.whl)
    echo "$sha  $wheel" | sha256sum -c --quiet -
    "$V/bin/python" -m zipfile -e "$wheel" "$work/modules"
    rm -rf "$out"
    mv "$work/modules" "$out"
    rm -rf "$work"
    touch "$out/.complete"
    log "vllm $version in $out ($(du -sh "$out" | cut -f1), $(( $(date +%s) - t0 )) s)"
  fi
  echo "$out"
done < <(releases)
# Folders of releases no longer pinned go.
keep=$(releases | while read -r version sha; do basename "$(folder "$version" "$sha")"; done)
find "$dest" -mindepth 1 -maxdepth 1 -type d ! -name '.*' -print0 | while IFS= read -r -d '' old; do
  grep -qxF "$(basename "$old")" <<<"$keep" || rm -rf "$old"
done
