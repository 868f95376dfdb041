#!/bin/sh
# Render DejaVu's Redis ACL file from users.acl.rules and the users' passwords, then exec redis-server.
#
# Passwords come from the environment: REDIS_PASSWORD_<NAME> for user NAME (upper case, '-' and '.' as
# '_'). Only their SHA-256 goes into the ACL file. A user name with '{id}' is a template: one user per
# worker id in REDIS_WORKER_IDS (comma separated; letters, digits, '.', '_', '-'). A missing or empty
# password, one with white space, or no worker user at all stops the start. Paths may be overridden (the tests do):
# REDIS_CONF, REDIS_ACL_RULES, REDIS_ACL_FILE and REDIS_DATA_DIR (where the append-only file lives;
# default /data, the volume).
# Extra arguments go to redis-server after the configuration file (e.g. --port 7000 --dir /tmp/x).
set -euf  # -f: no globbing, so a worker id is never expanded as a file pattern

here=$(dirname "$0")
conf=${REDIS_CONF:-$here/redis.conf}
rules=${REDIS_ACL_RULES:-$here/users.acl.rules}
acl=${REDIS_ACL_FILE:-/tmp/dejavu-users.acl}
data=${REDIS_DATA_DIR:-/data}

umask 077
tmp="$acl.tmp"
: >"$tmp"
workers=0

# add_user NAME RULES: append NAME's line, with its password's digest, to the ACL file.
add_user() {
    var="REDIS_PASSWORD_$(printf '%s' "$1" | tr 'a-z.-' 'A-Z__')"
    password=$(printenv "$var" || true)
    if [ -z "$password" ]; then
        echo "start.sh: $var is not set: user '$1' needs a password" >&2
        exit 1
    fi
    case "$password" in *[[:space:]]*)
        echo "start.sh: $var contains white space, which an ACL file cannot hold" >&2
        exit 1
        ;;
    esac
    digest=$(printf '%s' "$password" | sha256sum | cut -d' ' -f1)
    printf 'user %s on #%s %s\n' "$1" "$digest" "$2" >>"$tmp"
    case "$1" in worker-*) workers=$((workers + 1)) ;; esac
}

while read -r keyword name rest; do
    case "$keyword" in '' | '#'*) continue ;; esac
    if [ "$keyword" != user ] || [ -z "$name" ]; then
        echo "start.sh: $rules: expected 'user NAME RULES', got: $keyword $name" >&2
        exit 1
    fi
    case " $rest " in
    *" nopass "*)
        printf 'user %s %s\n' "$name" "$rest" >>"$tmp"
        continue
        ;;
    esac
    case "$name" in
    *'{id}'*)
        for id in $(printf '%s' "${REDIS_WORKER_IDS:-}" | tr ',' ' '); do
            case "$id" in *[!A-Za-z0-9._-]*)
                echo "start.sh: REDIS_WORKER_IDS: '$id' is not a worker id (letters, digits, '.', '_', '-')" >&2
                exit 1
                ;;
            esac
            add_user "$(printf '%s' "$name" | sed "s/{id}/$id/g")" "$(printf '%s' "$rest" | sed "s/{id}/$id/g")"
        done
        ;;
    *) add_user "$name" "$rest" ;;
    esac
done <"$rules"
if [ "$workers" -eq 0 ]; then
    echo "start.sh: no worker could log in: set REDIS_WORKER_IDS and their passwords" >&2
    exit 1
fi
mv "$tmp" "$acl"

exec redis-server "$conf" --dir "$data" --aclfile "$acl" "$@"
