#!/usr/bin/env bash
# The end-to-end scenario of e2e/test_scenario.py on a real cluster: whatever cluster the
# current kubectl context reaches (kind, k3d, a cloud cluster). It builds and ships the image,
# installs the operator (kubectl apply -k manifests/), and then walks the user's journey:
# apply a PagedLLM, wait, use it with the openai SDK (testing/pagedllm_testing/client_checks.py), scale, roll out
# while streaming, autoscale on queue depth, delete.
#
#   make install-test                   # the client script needs openai and httpx
#   e2e/real_cluster.sh                 # kind: build, `kind load`, run
#   SHIP=k3d e2e/real_cluster.sh        # k3d: `k3d image import`
#   SHIP=push IMAGE=registry.example.com/pagedllm:0.1.0 e2e/real_cluster.sh
#   SHIP=none e2e/real_cluster.sh       # the image is already where the nodes find it
#
# Settings (environment): IMAGE (pagedllm/pagedllm:0.1.0), SHIP (kind | k3d | push | none),
# KIND_CLUSTER (kind), K3D_CLUSTER (k3s-default), NAMESPACE (default), PYTHON (.venv/bin/python),
# PORT (8080, for kubectl port-forward), PROXY_PORT (8001, for kubectl proxy), KEEP=1 to leave
# the operator installed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-pagedllm/pagedllm:0.1.0}
SHIP=${SHIP:-kind}
KIND_CLUSTER=${KIND_CLUSTER:-kind}
K3D_CLUSTER=${K3D_CLUSTER:-k3s-default}
NAMESPACE=${NAMESPACE:-default}
PYTHON=${PYTHON:-.venv/bin/python}
PORT=${PORT:-8080}
PROXY_PORT=${PROXY_PORT:-8001}
NAME=demo
MODEL=demo
SELECTOR="pagedllm.io/instance=${NAME}"
K=(kubectl --namespace "$NAMESPACE")

STARTED=$(date +%s)
STEP_STARTED=$STARTED
STEP=""
BACKGROUND=()

step() {
    finish_step
    STEP="$*"
    STEP_STARTED=$(date +%s)
    printf '\n-> %s\n' "$STEP"
}

finish_step() {
    if [[ -n "$STEP" ]]; then
        printf '   %4ss  %s\n' "$(($(date +%s) - STEP_STARTED))" "$STEP"
    fi
}

on_exit() {
    local code=$?
    for pid in "${BACKGROUND[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    if [[ $code -ne 0 ]]; then
        printf '\nFAILED in step: %s\n' "$STEP"
        "${K[@]}" get pllm,deploy,rs,pods,svc,pdb -o wide || true
        "${K[@]}" describe pllm "$NAME" || true
        "${K[@]}" get events --sort-by=.lastTimestamp | tail -n 30 || true
        kubectl -n pagedllm-system logs deployment/pagedllm-operator --tail=100 || true
        for pod in $("${K[@]}" get pods -l "$SELECTOR" -o name 2>/dev/null); do
            echo "===== $pod"
            "${K[@]}" logs "$pod" --tail=40 || true
        done
    fi
    exit "$code"
}
trap on_exit EXIT

wait_for_url() {  # URL: until it answers, at most a minute
    for _ in $(seq 1 60); do
        if curl -fsS -o /dev/null "$1"; then return 0; fi
        sleep 1
    done
    echo "no answer from $1" >&2
    return 1
}

step "build the image $IMAGE"
docker build -f manifests/Dockerfile -t "$IMAGE" .

step "ship the image to the cluster ($SHIP)"
case "$SHIP" in
    kind) kind load docker-image "$IMAGE" --name "$KIND_CLUSTER" ;;
    k3d) k3d image import "$IMAGE" --cluster "$K3D_CLUSTER" ;;
    push) docker push "$IMAGE" ;;
    none) ;;
    *) echo "SHIP must be kind, k3d, push or none" >&2; exit 2 ;;
esac

step "kubectl apply -k manifests/ (namespace, CRD, RBAC, operator)"
kubectl apply -k manifests/
kubectl wait --for=condition=Established crd/pagedllms.pagedllm.io --timeout=60s
kubectl -n pagedllm-system set image deployment/pagedllm-operator operator="$IMAGE"
kubectl -n pagedllm-system rollout status deployment/pagedllm-operator --timeout=5m

step "kubectl apply a PagedLLM: demo model, 2 replicas (e2e/demo-pagedllm.yaml)"
kubectl patch --local -f e2e/demo-pagedllm.yaml --type=merge -o yaml \
    -p "{\"spec\":{\"image\":\"$IMAGE\"}}" | "${K[@]}" apply -f -

step "kubectl wait --for=condition=Ready pllm/$NAME"
"${K[@]}" wait --for=condition=Ready "pllm/$NAME" --timeout=10m
"${K[@]}" get pllm,pods -l "$SELECTOR" -o wide
"${K[@]}" get pllm "$NAME"

step "completions and chat through a port-forwarded Service (openai SDK)"
"${K[@]}" port-forward "svc/$NAME" "$PORT:80" >/dev/null &
BACKGROUND+=($!)
wait_for_url "http://127.0.0.1:$PORT/v1/models"
"$PYTHON" -m pagedllm_testing.client_checks --base-url "http://127.0.0.1:$PORT/v1" --model "$MODEL"

# kubectl port-forward pins one pod, which a rollout replaces; the API server's service proxy
# picks a ready endpoint per request, as clients inside the cluster see the Service.
"${K[@]}" proxy --port "$PROXY_PORT" >/dev/null &
BACKGROUND+=($!)
SERVICE_URL="http://127.0.0.1:$PROXY_PORT/api/v1/namespaces/$NAMESPACE/services/$NAME:http/proxy/v1"
wait_for_url "$SERVICE_URL/models"

step "kubectl scale pllm/$NAME --replicas=3: three ready pods"
"${K[@]}" scale "pllm/$NAME" --replicas=3
"${K[@]}" wait --for=jsonpath='{.status.readyReplicas}'=3 "pllm/$NAME" --timeout=10m
"${K[@]}" wait --for=condition=Ready "pllm/$NAME" --timeout=5m

step "rolling update (spec.engine.maxNumSeqs: 2) while a client keeps streaming"
"$PYTHON" -m pagedllm_testing.client_checks --base-url "$SERVICE_URL" --model "$MODEL" --stream-for 3600 &
STREAMER=$!
BACKGROUND+=("$STREAMER")
sleep 5
"${K[@]}" patch pllm "$NAME" --type=merge -p '{"spec":{"engine":{"maxNumSeqs":2}}}'
# Once the operator has observed the new generation, the Deployment has the new template, and
# `rollout status` waits for that rollout rather than reporting the finished previous one.
GENERATION=$("${K[@]}" get pllm "$NAME" -o jsonpath='{.metadata.generation}')
"${K[@]}" wait --for=jsonpath='{.status.observedGeneration}'="$GENERATION" "pllm/$NAME" \
    --timeout=2m
"${K[@]}" rollout status "deployment/$NAME" --timeout=15m
"${K[@]}" wait --for=condition=Ready "pllm/$NAME" --timeout=5m
sleep 5
kill -TERM "$STREAMER"
wait "$STREAMER"  # non-zero if any streamed request failed

step "autoscaling (min 1, max 3, waitingRequests): idle, down to min"
AUTOSCALING='{"minReplicas":1,"maxReplicas":3,"metric":"waitingRequests","target":2,"scaleDownDelaySeconds":30}'
"${K[@]}" patch pllm "$NAME" --type=merge -p "{\"spec\":{\"autoscaling\":$AUTOSCALING}}"
"${K[@]}" wait --for=jsonpath='{.spec.replicas}'=1 "pllm/$NAME" --timeout=5m
"${K[@]}" wait --for=jsonpath='{.status.replicas}'=1 "pllm/$NAME" --timeout=5m

step "load (8 streaming clients) raises queue depth: replicas grow"
"$PYTHON" -m pagedllm_testing.client_checks --base-url "$SERVICE_URL" --model "$MODEL" --load 8 \
    --duration 3600 &
LOAD=$!
BACKGROUND+=("$LOAD")
"${K[@]}" wait --for=jsonpath='{.spec.replicas}'=3 "pllm/$NAME" --timeout=5m
"${K[@]}" wait --for=jsonpath='{.status.readyReplicas}'=3 "pllm/$NAME" --timeout=10m
"${K[@]}" get events --field-selector reason=ScaledUp

step "load stops: back to min after scaleDownDelaySeconds"
kill -TERM "$LOAD"
wait "$LOAD"
"${K[@]}" wait --for=jsonpath='{.spec.replicas}'=1 "pllm/$NAME" --timeout=5m
"${K[@]}" wait --for=jsonpath='{.status.replicas}'=1 "pllm/$NAME" --timeout=5m
"${K[@]}" get events --field-selector reason=ScaledDown

step "kubectl delete pllm/$NAME: pods and Service gone"
"${K[@]}" delete pllm "$NAME" --timeout=2m
"${K[@]}" wait --for=delete pod -l "$SELECTOR" --timeout=5m
if "${K[@]}" get svc "$NAME" >/dev/null 2>&1; then
    echo "Service $NAME is still there" >&2
    exit 1
fi

if [[ "${KEEP:-0}" != 1 ]]; then
    step "kubectl delete -k manifests/ (the operator)"
    kubectl delete -k manifests/ --ignore-not-found --timeout=5m
fi
finish_step
STEP=""
printf '\nscenario passed in %ss\n' "$(($(date +%s) - STARTED))"
