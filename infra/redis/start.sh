#!/bin/sh
# Render DejaVu's Redis ACL file from users.acl.rules and the users' passwords, then exec redis-server.
#
# Passwords come from the environment: REDIS_PASSWORD_<NAME> for user NAME (upper case, '-' as '_').
# Only their SHA-256 goes into the ACL file. A missing or empty password, or one with white space, stops
# the start. Paths may be overridden (the tests do): REDIS_CONF, REDIS_ACL_RULES, REDIS_ACL_FILE and
# REDIS_DATA_DIR (where the append-only file lives; default /data, the volume).
# Extra arguments go to redis-server after the configuration file (e.g. --port 7000 --dir /tmp/x).
set -eu

here=$(dirname "$0")
conf=${REDIS_CONF:-$here/redis.conf}
rules=${REDIS_ACL_RULES:-$here/users.acl.rules}
acl=${REDIS_ACL_FILE:-/tmp/dejavu-users.acl}
data=${REDIS_DATA_DIR:-/data}

umask 077
tmp="$acl.tmp"
: >"$tmp"
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
    var="REDIS_PASSWORD_$(printf '%s' "$name" | tr 'a-z-' 'A-Z_')"
    password=$(printenv "$var" || true)
    if [ -z "$password" ]; then
        echo "start.sh: $var is not set: user '$name' needs a password" >&2
        exit 1
    fi
    case "$password" in *[[:space:]]*)
        echo "start.sh: $var contains white space, which an ACL file cannot hold" >&2
        exit 1
        ;;
    esac
    digest=$(printf '%s' "$password" | sha256sum | cut -d' ' -f1)
    printf 'user %s on #%s %s\n' "$name" "$digest" "$rest" >>"$tmp"
done <"$rules"
mv "$tmp" "$acl"

exec redis-server "$conf" --dir "$data" --aclfile "$acl" "$@"
