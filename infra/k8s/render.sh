#!/bin/sh
# Print the manifests of one overlay, as `kubectl apply -f -` takes them.
#
# Usage: render.sh OVERLAY [REGISTRY]
# OVERLAY is a folder name under infra/k8s/overlays (cpu, gpu). With REGISTRY (e.g. ghcr.io/acme), the
# DejaVu images are pulled from there: a throw-away kustomization on top of the overlay renames them, so
# no file of the repository changes. The base's secrets.env must exist (infra/secrets/generate.sh).
set -eu

if [ "$#" -lt 1 ] || [ "$#" -gt 2 ]; then
    echo "usage: $0 OVERLAY [REGISTRY]" >&2
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
overlay="$here/overlays/$1"
registry=${2:-}
if [ ! -f "$overlay/kustomization.yaml" ]; then
    echo "render.sh: no overlay '$1' under $here/overlays" >&2
    exit 2
fi
if [ -z "$registry" ]; then
    exec kubectl kustomize "$overlay"
fi

# Inside overlays/: kustomize takes only relative paths to other kustomizations.
work=$(mktemp -d "$here/overlays/.registry.XXXXXX")
trap 'rm -rf "$work"' EXIT
{
    echo "apiVersion: kustomize.config.k8s.io/v1beta1"
    echo "kind: Kustomization"
    echo "resources:"
    echo "  - ../$1"
    echo "images:"
    for image in dejavu-controller dejavu-prompt-worker dejavu-token-worker; do
        echo "  - name: $image"
        echo "    newName: ${registry%/}/$image"
    done
} >"$work/kustomization.yaml"
kubectl kustomize "$work"
