#!/bin/sh
# Write a deployment's credentials, fresh and random, to an env file (KEY=VALUE lines), unless it exists.
#
# Usage: generate.sh FILE [WORKER_ID...]
# The same keys serve Compose (--env-file, for ${...} interpolation) and Kubernetes (the secretGenerator
# of infra/k8s/base). Each worker id gets its own Redis password (REDIS_PASSWORD_WORKER_<ID>, the id
# upper-cased with '-' and '.' as '_'); the default ids are the Compose file's and the Kubernetes base's
# workers. Scaling a deployment up means new ids: delete FILE and run this again with all of them (and
# list them in the Redis service's REDIS_WORKER_IDS). An existing FILE is left as it is, so re-deploying keeps the credentials; delete it
# to rotate them. The file is created readable by its owner only and must never be committed.
set -eu

if [ "$#" -lt 1 ]; then
    echo "usage: $0 FILE [WORKER_ID...]" >&2
    exit 2
fi
file=$1
shift
if [ "$#" -eq 0 ]; then
    # Compose's workers ('<p|t>-<hostname>') and the Kubernetes pods ('<p|t>-<pod name>').
    set -- p-prompt-worker-0 p-prompt-worker-1 t-token-worker-0 t-token-worker-1 t-token-worker-spare \
        t-token-worker-spare-0
fi
for id in "$@"; do
    case "$id" in '' | *[!A-Za-z0-9._-]*)
        echo "$0: '$id' is not a worker id (letters, digits, '.', '_', '-')" >&2
        exit 2
        ;;
    esac
done
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
# The admin key pair (Ed25519, each key as base64 of its raw 32 bytes): the admin tool signs commands
# with the private key, workers get only the public key. A PKCS#8 DER Ed25519 key ends with its
# 32-byte seed, an SPKI DER public key with its 32 raw bytes.
der="$file.ed25519.tmp"
trap 'rm -f "$der" "$tmp"' EXIT
openssl genpkey -algorithm ed25519 -outform DER -out "$der"
admin_signing_key=$(tail -c 32 "$der" | base64)
admin_verify_key=$(openssl pkey -inform DER -in "$der" -pubout -outform DER | tail -c 32 | base64)
cat >"$tmp" <<END
REDIS_PASSWORD_CONTROLLER=$(token)
REDIS_PASSWORD_ADMIN=$(token)
DATA_PLANE_SECRET=$(token)
ADMIN_SIGNING_KEY=$admin_signing_key
ADMIN_VERIFY_KEY=$admin_verify_key
CONTROLLER_API_KEYS=["$(token)"]
END
for id in "$@"; do
    echo "REDIS_PASSWORD_WORKER_$(printf '%s' "$id" | tr 'a-z.-' 'A-Z__')=$(token)" >>"$tmp"
done
mv "$tmp" "$file"
echo "wrote new credentials to $file" >&2
