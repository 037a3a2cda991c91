#!/usr/bin/env bash
# Set up a virtualenv in .venv (Python >= 3.12) and run one of the project's jobs.
#   bash scripts/bootstrap.sh serve [ZOO SERVE ARGS]  install zoo, run the main job: `zoo serve` (by default
#                                                    the tiny embedded model on 127.0.0.1:8000)
#   bash scripts/bootstrap.sh test [PYTEST ARGS]      install zoo[dev], lint (ruff), run the whole test suite
#   bash scripts/bootstrap.sh generate [PROMPT]       install zoo, generate with the tiny embedded model
set -euo pipefail
cd "$(dirname "$0")/.."
job="${1:-serve}"; shift || true

py=""
for cand in python3.12 python3 python; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
    py="$cand"; break
  fi
done
[ -n "$py" ] || { echo "zoo needs Python >= 3.12 (python3.12 or python3); none found" >&2; exit 1; }

[ -x .venv/bin/python ] || "$py" -m venv .venv

# Python writes the bytecode of what it imports into .venv and the checkout (both ignored by git), even
# where the environment sets PYTHONDONTWRITEBYTECODE: there, every process would compile JAX, torch and
# zoo from source again (measured: `import zoo.server.app` 4.4 s without bytecode, 1.5 s with it; a CLI
# test file 15 s against 7 s). The first import of each module writes it; uv's --compile-bytecode
# would compile every installed module at install instead (50 s more, mostly modules no job imports).
unset PYTHONDONTWRITEBYTECODE

# install REQUIREMENT: with uv where it installs (~30 s for the test extra against pip's ~150 s), taking
# pip's configured package sources (scripts/uv_flags.py); with pip otherwise, or if uv fails.
install() {
  local pip=(.venv/bin/python -m pip install -q --disable-pip-version-check --no-cache-dir)
  if "${pip[@]}" 'uv==0.13.9' >/dev/null 2>&1 && mapfile -t flags < <(.venv/bin/python scripts/uv_flags.py) &&
     .venv/bin/uv pip install -q --python .venv/bin/python --no-cache "${flags[@]}" "$@"; then
    return 0
  fi
  echo "installing with pip" >&2
  "${pip[@]}" "$@"
}
case "$job" in
  serve)
    install -e .
    exec .venv/bin/zoo serve "$@" ;;
  generate)
    install -e .
    exec .venv/bin/zoo generate --model qwen38-tiny --prompt "${1:-Hello, zoo!}" --max-tokens 32 ;;
  test)
    install -e '.[dev]'
    .venv/bin/ruff check . || { echo "lint failed (ruff; settings in pyproject.toml)" >&2; exit 1; }
    set +e
    # --no-loadscope-reorder: the files run in the order tests/conftest.py gives (heaviest first); xdist
    # would otherwise sort them by their number of tests, and the long multi-process files ran last
    .venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder -q --durations=15 "$@"
    rc=$?
    [ "$rc" -eq 5 ] && { echo "no tests were collected" >&2; exit 1; }
    exit "$rc" ;;
  *) echo "usage: bash scripts/bootstrap.sh serve|test|generate [args]" >&2; exit 2 ;;
esac
