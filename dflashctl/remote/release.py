"""Pure argv and script builders for deploying a release: the deploy lock, the preflight and
memory probes, the unpack, the switch of `current`, the switch marker.

The services (dflashctl.releases.deploy, dflashctl.releases.preflight) keep the order of these steps and judge
their output; the paths are dflashctl.remote.layout's. Every variable value travels as a
positional parameter ("$1"), never in the script text.
"""

from __future__ import annotations

from dflashctl.remote import layout as L

# --- the deploy lock -------------------------------------------------------------------------

LOCK_HELD_RC = 75
"""`locked_argv`/`take_over_argv`: another deploy holds the lock (or won the take-over)."""
NO_WORKDIR_RC = 74
"""`locked_argv`: the workdir cannot be created."""
LOCK_BUSY_RC = 76
"""`break_lock_argv`: an unpack or switch for this workdir runs in the container."""


def locked_argv(workdir: str, owner: str, argv: list[str]) -> list[str]:
    """Take WORKDIR/.deploy.lock (mkdir is atomic), then exec argv: one round trip.

    Exit 75 with "held by: OWNER" when another deploy holds it; any other exit status means we
    hold it (even if argv itself failed) and must release it.
    """
    script = (
        f'mkdir -p "$1" || exit {NO_WORKDIR_RC}; '
        f'if ! mkdir "$1/{L.DEPLOY_LOCK}" 2>/dev/null; then '
        f'echo "held by: $(cat "$1/{L.DEPLOY_LOCK_OWNER}" 2>/dev/null)"; exit {LOCK_HELD_RC}; fi; '
        f'printf "%s\\n" "$2" > "$1/{L.DEPLOY_LOCK_OWNER}"; shift 2; exec "$@"'
    )
    return ["sh", "-c", script, "dflash-lock", workdir, owner, *argv]


def unlock_argv(workdir: str, owner: str) -> list[str]:
    """Remove the deploy lock only if it is ours (its owner line matches)."""
    script = (
        f'l="$1/{L.DEPLOY_LOCK}"; '
        'if [ "$(cat "$l/owner" 2>/dev/null)" = "$2" ]; then rm -rf "$l"; fi'
    )
    return ["sh", "-c", script, "dflash-unlock", workdir, owner]


def take_over_argv(workdir: str, owner: str) -> list[str]:
    """Remove the lock only if `owner` still holds it (atomic rename: one taker wins)."""
    script = (
        f'l="$1/{L.DEPLOY_LOCK}"; [ "$(cat "$l/owner" 2>/dev/null)" = "$2" ] || '
        f"exit {LOCK_HELD_RC}; "
        f'mv "$l" "$l.stale.$$" 2>/dev/null || exit {LOCK_HELD_RC}; rm -rf "$l.stale.$$"'
    )
    return ["sh", "-c", script, "dflash-takeover", workdir, owner]


def read_lock_owner_argv(workdir: str) -> list[str]:
    """Print the lock's owner line (nothing without a lock); always exit 0."""
    return [
        "sh",
        "-c",
        f'cat "$1/{L.DEPLOY_LOCK_OWNER}" 2>/dev/null; exit 0',
        "dflash-owner",
        workdir,
    ]


# $1 workdir. Refuses (76) while an unpack or switch for this workdir runs in the container.
BREAK_LOCK_SCRIPT = rf"""l="$1/{L.DEPLOY_LOCK}"
[ -d "$l" ] || {{ echo "no lock"; exit 0; }}
for f in /proc/[0-9]*/cmdline; do
  c=$(tr '\0' ' ' < "$f" 2>/dev/null) || continue
  case "$c" in
    *"dflash-unpack $1 "*|*"dflash-switch $1 "*) p=${{f#/proc/}}; echo "busy: pid ${{p%/cmdline}}"; exit {LOCK_BUSY_RC};;
  esac
done
echo "broke: $(cat "$l/owner" 2>/dev/null)"
rm -rf "$l"
"""


def break_lock_argv(workdir: str) -> list[str]:
    return ["sh", "-c", BREAK_LOCK_SCRIPT, "dflash-break-lock", workdir]


# --- the switch marker -----------------------------------------------------------------------


def acknowledge_switch(workdir: str, owner: str | None = None) -> list[str]:
    """Remove the switch marker (only if `owner` wrote it, when given): it has been reported."""
    script = (
        f'm="$1/{L.SWITCH_MARKER}"; '
        'if [ -z "$2" ] || [ "$(head -n 1 "$m" 2>/dev/null | cut -f 1)" = "$2" ]; then '
        'rm -f "$m"; fi'
    )
    return ["sh", "-c", script, "dflash-ack", workdir, owner or ""]


# --- unpack and switch -----------------------------------------------------------------------

# $1 workdir, $2 release id, $3 python, $4 verify script. Tar archive on stdin.
UNPACK_SCRIPT = rf"""set -e
cd "$1"
mkdir -p {L.RELEASES}
rm -rf {L.RELEASES}/.tmp-*
tmp="{L.RELEASES}/.tmp-$2-$$"
mkdir "$tmp"
tar -x -f - -C "$tmp" --no-same-owner
got=$("$3" -c "$4" "$tmp" trainer)
if [ "$got" != "$2" ]; then
  rm -rf "$tmp"
  echo "unpacked tree hashes to $got, expected $2 (transfer corrupted?)" >&2
  exit 3
fi
touch "$tmp/{L.RELEASE_COMPLETE}"
rm -rf "{L.RELEASES}/$2"
mv -T "$tmp" "{L.RELEASES}/$2"
"""


def unpack_argv(workdir: str, release: str, python: str, verify_script: str) -> list[str]:
    """Unpack the tar on stdin into releases/<release>, verified by `verify_script` (the tree
    hash, run by the container's python) before it gets its name."""
    return ["sh", "-c", UNPACK_SCRIPT, "dflash-unpack", workdir, release, python, verify_script]


# $1 workdir, $2 release id, $3 releases to keep, $4 "config" when the run config comes on stdin,
# $5 owner. Writes the config (temp + rename), records the switch in .deploy-switched (an older,
# unreported one is printed first), switches `current`, prunes, and releases the deploy lock
# last; `set -e` leaves the lock for the caller's cleanup if anything fails.
SWITCH_SCRIPT = rf"""set -e
cd "$1"
test -f "{L.RELEASES}/$2/{L.RELEASE_COMPLETE}"
if [ "$4" = config ]; then
  mkdir -p {L.RUN_DIR}
  cat > "{L.RUN_DIR}/.config.toml.tmp.$$"
  mv -f "{L.RUN_DIR}/.config.toml.tmp.$$" {L.CONFIG}
fi
if [ -s {L.SWITCH_MARKER} ]; then printf 'unreported: %s\n' "$(cat {L.SWITCH_MARKER})"; fi
printf '%s\t%s\t%s\n' "$5" "$(readlink {L.CURRENT} 2>/dev/null || true)" "$2" > {L.SWITCH_MARKER}
ln -s "{L.RELEASES}/$2" ".{L.CURRENT}.tmp.$$"
mv -T ".{L.CURRENT}.tmp.$$" {L.CURRENT}
keep="$2 $(cat {L.RUNNING_RELEASE} 2>/dev/null || true)"
n=0
for m in $(ls -1t {L.RELEASES}/*/{L.RELEASE_COMPLETE} 2>/dev/null); do
  d=${{m%/{L.RELEASE_COMPLETE}}}; h=${{d#{L.RELEASES}/}}
  case " $keep " in *" $h "*) continue;; esac
  n=$((n+1))
  if [ "$n" -ge "$3" ]; then rm -rf "$d"; echo "pruned $h"; fi
done
rm -rf {L.DEPLOY_LOCK}
"""


def switch_argv(
    workdir: str, release: str, keep: int, *, with_config: bool = False, owner: str = "-"
) -> list[str]:
    """Write the config (when it comes on stdin), switch `current`, prune, unlock."""
    flag = "config" if with_config else "-"
    return ["sh", "-c", SWITCH_SCRIPT, "dflash-switch", workdir, release, str(keep), flag, owner]
