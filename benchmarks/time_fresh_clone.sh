#!/usr/bin/env bash
# Wall time of the README's two commands on a fresh clone of this repository, as a markdown table.
#
# Usage (from anywhere inside the repository):
#   benchmarks/time_fresh_clone.sh            # make test, then make book
#   benchmarks/time_fresh_clone.sh book       # only make book (SCALE=laptop by default)
#   benchmarks/time_fresh_clone.sh test       # only make test
# (Linux: it reads /proc for the processor and the load average.)
#
# Each command runs in its own clone under a temporary folder (kept, with its log, for inspection).
# make book shows the committed results; the last row names the chapters it had to compute (those whose
# results were missing or held other settings), which should be none. The table, with the machine and
# its load average just before, is printed; when make book was timed it is also written to
# benchmarks/fresh_clone.md (shown by the book's how_to_run page). Measure on an otherwise idle machine:
# the load average before the start is the only check of that here.
set -uo pipefail

src=$(git rev-parse --show-toplevel)
what=${1:-both}
case $what in
  both|test|book) ;;
  *) echo "usage: $0 [test|book|both]" >&2; exit 2 ;;
esac
rows=()
load_before=$(cut -d' ' -f1 /proc/loadavg)
# where .venv's packages can come from without a download: pip's cache, and a local wheel folder or index
cache_dir=$(python3 -m pip cache dir 2>/dev/null || echo "$HOME/.cache/pip")
if [[ -d $cache_dir ]]; then pip_cache="$(du -sm "$cache_dir" 2>/dev/null | cut -f1) MB"; else pip_cache="nothing (no cache folder)"; fi
pip_local=$(python3 -m pip config list 2>/dev/null | grep -cE '(find-links|index-url)')
for target in test book; do
  [[ $what == both || $what == "$target" ]] || continue
  dir=$(mktemp -d)
  git clone -q "$src" "$dir/clone"
  start=$(date +%s)
  (cd "$dir/clone" && make "$target" > "$dir/make-$target.log" 2>&1)
  status=$?
  minutes=$(awk -v s="$(( $(date +%s) - start ))" 'BEGIN { printf "%.1f", s / 60 }')
  rows+=("| make $target | $minutes | $status |")
  echo "make $target: log in $dir/make-$target.log" >&2
  if [[ $target == book ]]; then
    computed=$(cd "$dir/clone" && git status --porcelain -- results | awk '{print $2}' | cut -d/ -f3 | sort -u | tr '\n' ' ')
    rows+=("| of which chapters computed (not read) | ${computed:-none} | |")
  fi
done
cpu=$(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo 2>/dev/null)
{
  echo "Machine: ${cpu:-unknown processor}, $(nproc) cores; load average (1 min) before the start: ${load_before};"
  echo "pip's download cache held ${pip_cache:-an unknown amount} before the start; pip's configuration"
  echo "names ${pip_local:-0} wheel folder or index setting(s) (find-links, index-url), which can serve packages from"
  echo "this machine's disk: a machine without them downloads what they hold, and takes longer."
  echo
  echo "| command | wall time (min) | exit status |"
  echo "|---|---|---|"
  printf '%s\n' "${rows[@]}"
} > "$dir/table.md"
cat "$dir/table.md"
if [[ $what != test ]]; then
  cp "$dir/table.md" "$src/benchmarks/fresh_clone.md"
fi
