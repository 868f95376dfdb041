#!/bin/sh
# Write a deployment's credentials, fresh and random, to an env file (KEY=VALUE lines), unless it exists.
#
# Usage: generate.sh FILE
# The same keys serve Compose (--env-file, for ${...} interpolation) and Kubernetes (the secretGenerator
# of infra/k8s/base). An existing FILE is left as it is, so re-deploying keeps the credentials; delete it
# to rotate them. The file is created readable by its owner only and must never be committed.
set -eu

if [ "$#" -ne 1 ]; then
    echo "usage: $0 FILE" >&2
    exit 2
fi
file=$1
if [ -e "$file" ]; then
    echo "$file exists: keeping its credentials" >&2
    exit 0
fi

# 32 random bytes as hex: no character that an ACL file, a URL or an env file would need quoted.
token() {
    od -An -tx1 -N32 /dev/urandom | tr -d ' \n'
}

umask 077
tmp="$file.tmp"
cat >"$tmp" <<END
REDIS_PASSWORD_CONTROLLER=$(token)
REDIS_PASSWORD_WORKER=$(token)
REDIS_PASSWORD_ADMIN=$(token)
DATA_PLANE_SECRET=$(token)
ADMIN_CREDENTIAL=$(token)
CONTROLLER_API_KEYS=["$(token)"]
END
mv "$tmp" "$file"
echo "wrote new credentials to $file" >&2
