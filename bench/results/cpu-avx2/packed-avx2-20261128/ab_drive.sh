#!/bin/bash
# ABBA rounds of before (a checkout of 11975bc, set up) and after (this change), data job paused throughout.
# Usage: ab_drive.sh BEFORE_CHECKOUT AFTER_CHECKOUT   (writes ab-<tag>-<n>.json beside this script)
here=$(cd "$(dirname "$0")" && pwd)
pkill -STOP -f "redrafter-mlx distill"
sleep 3
uptime
for tag in before after after before before after; do
  if [ $tag = before ]; then dir=$1; else dir=$2; fi
  n=$(ls "$here"/ab-$tag-*.json 2>/dev/null | wc -l)
  (cd "$dir" && .venv/bin/python "$here/ab_proc.py" "$here/ab-$tag-$((n+1)).json") 2>&1 | sed "s/^/$tag: /"
done
uptime
pkill -CONT -f "redrafter-mlx distill"
