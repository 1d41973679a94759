#!/usr/bin/env bash
# Wall time of the README's two commands on a fresh clone of this repository, as a markdown table.
#
# Usage (from anywhere inside the repository):
#   benchmarks/time_fresh_clone.sh            # make test, then make book
#   benchmarks/time_fresh_clone.sh book       # only make book (SCALE=laptop by default)
#
# Each command runs in its own clone under a temporary folder (kept, with its log, for inspection).
# make book shows the committed results; the last row names the chapters it had to compute (those whose
# results were missing or held other settings), which should be none.
set -uo pipefail

src=$(git rev-parse --show-toplevel)
what=${1:-both}
rows=()
for target in test book; do
  [[ $what == both || $what == "$target" ]] || continue
  dir=$(mktemp -d)
  git clone -q "$src" "$dir/clone"
  start=$(date +%s)
  (cd "$dir/clone" && make "$target" > "$dir/make-$target.log" 2>&1)
  status=$?
  minutes=$(awk -v s="$(( $(date +%s) - start ))" 'BEGIN { printf "%.1f", s / 60 }')
  rows+=("| make $target | $minutes | $status | $dir/make-$target.log |")
  if [[ $target == book ]]; then
    computed=$(cd "$dir/clone" && git status --porcelain -- results | awk '{print $2}' | cut -d/ -f3 | sort -u | tr '\n' ' ')
    rows+=("| of which chapters computed (not read) | ${computed:-none} | | |")
  fi
done
echo "| command | wall time (min) | exit status | log |"
echo "|---|---|---|---|"
printf '%s\n' "${rows[@]}"
