#!/bin/sh
# Print Secret prefix-router-redis with a fresh random password: the URL the components
# use and the in-cluster Redis's ACL file, which must name the same user and password.
#
#   deploy/k8s/redis-secret.sh --files DIR    # DIR/redis-url and DIR/redis-users.acl, for
#                                             # an overlay's secretGenerator (the install)
#   deploy/k8s/redis-secret.sh | kubectl -n prefix-router apply -f -   # the Secret itself
#
# The ACL: the default (unauthenticated) user may only PING (the probes); USER may run
# everything but Redis's @dangerous commands (FLUSHALL, KEYS, CONFIG, ...) on keys and
# channels under the namespace the components use (REDIS_NAMESPACE in kustomization.yaml).
# Settings (environment): REDIS_USER (prefix-router), REDIS_HOST (redis), REDIS_PORT (6379),
# REDIS_NAMESPACE (prefix-router:), REDIS_SCHEME (redis; rediss for TLS).
set -eu
user=${REDIS_USER:-prefix-router}
host=${REDIS_HOST:-redis}
port=${REDIS_PORT:-6379}
namespace=${REDIS_NAMESPACE:-prefix-router:}
scheme=${REDIS_SCHEME:-redis}
password=$(openssl rand -hex 32)
url="${scheme}://${user}:${password}@${host}:${port}/0"
acl="user default on nopass -@all +ping
user ${user} on >${password} ~${namespace}* &${namespace}* +@all -@dangerous"
if [ "${1:-}" = "--files" ]; then
  dir=${2:?usage: redis-secret.sh --files DIR}
  mkdir -p "$dir"
  (umask 077 && printf '%s\n' "$url" > "$dir/redis-url" && printf '%s\n' "$acl" > "$dir/redis-users.acl")
  exit 0
fi
cat <<SECRET
apiVersion: v1
kind: Secret
metadata:
  name: prefix-router-redis
type: Opaque
stringData:
  url: "${url}"
  users.acl: |
$(printf '%s\n' "$acl" | sed 's/^/    /')
SECRET
