#!/usr/bin/env bash
# Wall time of the README's two commands on a fresh clone of this repository, as a markdown table.
#
# Usage (from anywhere inside the repository):
#   benchmarks/time_fresh_clone.sh            # make test, then make book (about an hour on 2 cores)
#   benchmarks/time_fresh_clone.sh book       # only make book (SCALE=laptop by default)
#
# Each command runs in its own clone under a temporary folder (kept, with its log, for inspection);
# the notebook rows come from the wall times in the manifests the notebooks write.
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
  # (only after a successful run: otherwise the manifests are the committed ones, not this run's)
  if [[ $target == book && $status == 0 ]]; then
    for study in toy mnist mnist_growth; do
      manifest="$dir/clone/results/laptop/$study/manifest.json"
      [[ -f $manifest ]] || continue
      wall=$(python3 -c "import json, sys; print(f\"{json.load(open(sys.argv[1]))['wall_time_s'] / 60:.1f}\")" "$manifest")
      rows+=("| of which: $study notebook | $wall | | $manifest |")
    done
  fi
done
echo "| command | wall time (min) | exit status | log |"
echo "|---|---|---|---|"
printf '%s\n' "${rows[@]}"
