#!/usr/bin/env bash
# Cron entry point: when the target checkpoint at TARGET_DIR changed since the last run, run the retrain hook.
#
#   */30 * * * * TARGET_DIR=/models/prod-target DRAFTSMITH_REGISTRY=/shared/draftsmith/registry \
#                /opt/draftsmith/scripts/cron_target_updated.sh >> /var/log/draftsmith-hook.log 2>&1
#
# "Changed" means the target fingerprint (config + weights, drafts.identity) differs from the one this
# script last handled, which it keeps in $STATE_FILE. That fingerprint is passed as baseline=, so the
# hook compares against exactly the target the drafts were serving. The first run only remembers the
# fingerprint, unless BASELINE= (an old target dir or registered fingerprint) says what to compare with. The state only advances when the
# hook ended with 0 or 3 (a retrained-but-not-promoted candidate is a human's call, not a retry loop);
# on 2 the next cron tick tries again. Two overlapping ticks are fine: the hook locks the registry.
set -uo pipefail

: "${TARGET_DIR:?set TARGET_DIR to the target checkpoint dir}"
: "${DRAFTSMITH_REGISTRY:?set DRAFTSMITH_REGISTRY to the draft registry root}"
STATE_FILE=${STATE_FILE:-$DRAFTSMITH_REGISTRY/cron-$(echo "$TARGET_DIR" | tr '/' '_').last}
REPO=${DRAFTSMITH_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
export WANDB_MODE=${WANDB_MODE:-offline}

stamp() { date -u +%Y-%m-%dT%H:%M:%SZ; }

current=$("$PYTHON" -c 'import sys; from draftsmith.drafts.identity import target_fingerprint; print(target_fingerprint(sys.argv[1]))' "$TARGET_DIR") || {
  echo "$(stamp) cannot fingerprint $TARGET_DIR (mid-copy?); will retry next tick"; exit 2; }
remember() { mkdir -p "$(dirname "$STATE_FILE")" && echo "$current" > "$STATE_FILE.tmp" && mv "$STATE_FILE.tmp" "$STATE_FILE"; }
last=$(cat "$STATE_FILE" 2>/dev/null || true)
baseline=${BASELINE:-$last}
if [[ "$current" == "$last" ]]; then
  exit 0  # unchanged: nothing to do, say nothing
fi
if [[ -z "$baseline" ]]; then
  remember
  echo "$(stamp) first run: remembering target fingerprint $current"
  exit 0
fi

echo "$(stamp) target $TARGET_DIR changed: $baseline -> $current"
"$PYTHON" -m draftsmith.train.cli hook target-updated "target.path=$TARGET_DIR" "baseline=$baseline" \
  "registry=$DRAFTSMITH_REGISTRY" "lock_timeout=${LOCK_TIMEOUT:-3600}" "$@"
code=$?
case $code in
  0) echo "$(stamp) hook: drafts up to date for $current" ;;
  3) echo "$(stamp) hook: retrained, candidate NOT promoted; review with: draftsmith drafts list --target $current" ;;
  *) echo "$(stamp) hook failed (exit $code); will retry next tick"; exit "$code" ;;
esac
remember
exit "$code"
