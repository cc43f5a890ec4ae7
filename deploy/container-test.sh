#!/usr/bin/env bash
# Container smoke test without a Docker daemon: debootstrap a Debian+Python base, build the
# Dockerfile on it with buildah (overlay or vfs storage, chroot isolation), check the image from the
# outside (user, HEALTHCHECK, no compilers or test packages, portable kernels), run its entrypoint
# on a loopback port and check /ready, the HEALTHCHECK, a streamed completion, /metrics, SIGTERM.
#
# Needs root and the Debian packages buildah and debootstrap, plus curl. Base rootfs and image
# layers are cached under $SLIPSTREAM_CONTAINER_CACHE (default ~/.cache/slipstream), so a rerun
# only rebuilds what changed. Any failed step exits non-zero with the step named.
set -euo pipefail
shopt -s inherit_errexit

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=${CONTAINER_TEST_CONTEXT:-$(dirname "$SCRIPT_DIR")}
CACHE_ROOT=${SLIPSTREAM_CONTAINER_CACHE:-$HOME/.cache/slipstream}
SUITE=${DEBIAN_SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# python3-venv brings ensurepip, which the Dockerfile's builder stage needs for `python3 -m venv`.
BASE_PACKAGES=python3,python3-venv,ca-certificates
IMAGE=${CONTAINER_TEST_IMAGE:-localhost/slipstream:container-test}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-900}
# Small engine limits keep start-up compilation short on a 2-core CI machine.
SERVE_ARGS=(--max-slots 4 --max-seq-len 512 --kv-cache-memory 64MiB --shutdown-timeout 10)

BASE_KEY=$(printf '%s|%s|%s|v1' "$SUITE" "$MIRROR" "$BASE_PACKAGES" | sha256sum | cut -c1-12)
BASE_DIR=$CACHE_ROOT/container-base/$SUITE-$BASE_KEY
BASE_IMAGE=localhost/slipstream-base:$SUITE-$BASE_KEY
COMPILE_CACHE_DIR=$CACHE_ROOT/container-compile-cache
LOG_DIR=$(mktemp -d /tmp/slipstream-container-test.XXXXXX)

overlay_works() {  # whether this kernel mounts overlayfs on the cache's file system (root only)
    local d status=1
    mkdir -p "$CACHE_ROOT" && d=$(mktemp -d "$CACHE_ROOT/.overlay-probe.XXXXXX") && mkdir "$d"/{l,u,w,m}
    mount -t overlay overlay -o "lowerdir=$d/l,upperdir=$d/u,workdir=$d/w" "$d/m" 2>/dev/null \
        && umount "$d/m" && status=0
    rm -rf "$d"
    return $status
}
# overlay shares unchanged files between layers. vfs works anywhere (no overlay mounts, no fuse) but
# copies the whole rootfs per layer and per container: a cold build wrote ~30 GB and took 2x longer.
if [ -n "${CONTAINER_TEST_STORAGE_DRIVER:-}" ]; then
    STORAGE_DRIVER=$CONTAINER_TEST_STORAGE_DRIVER STORAGE_WHY="CONTAINER_TEST_STORAGE_DRIVER"
elif [ "$(id -u)" -eq 0 ] && overlay_works; then
    STORAGE_DRIVER=overlay STORAGE_WHY="overlay mounts work here"
else
    STORAGE_DRIVER=vfs STORAGE_WHY="no overlay mount here: every layer is a full copy"
fi
# The last build's cache key, and its kernel compiler commands (checked again on a cached run).
STAMP=$CACHE_ROOT/container-image-$STORAGE_DRIVER.key
KERNEL_FLAGS=$CACHE_ROOT/container-image-$STORAGE_DRIVER.kernel-build
BUILDAH=(buildah --storage-driver "$STORAGE_DRIVER" --root "$CACHE_ROOT/container-storage-$STORAGE_DRIVER"
         --runroot "$CACHE_ROOT/container-runroot-$STORAGE_DRIVER")
export BUILDAH_ISOLATION=chroot

STEP_NAMES=()
STEP_TIMES=()
FACTS=()  # measured values for the summary: "name: value"
CURRENT_STEP=""
CONTAINER=""
SERVER_PID=""

die() {
    echo "container-test: FAILED in step '$CURRENT_STEP': $*" >&2
    exit 1
}

step() {  # step NAME FUNCTION: runs FUNCTION, records its wall time
    CURRENT_STEP=$1
    echo "==> $1"
    local start=$EPOCHREALTIME
    "$2"
    STEP_NAMES+=("$1")
    STEP_TIMES+=("$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')")
}

summary() {
    local status=$1 i total=0
    echo
    echo "container-test summary ($([ "$status" -eq 0 ] && echo PASSED || echo "FAILED at '$CURRENT_STEP'"))"
    for i in "${!STEP_NAMES[@]}"; do
        printf '  %-34s %8ss\n' "${STEP_NAMES[$i]}" "${STEP_TIMES[$i]}"
        total=$(awk -v a="$total" -v b="${STEP_TIMES[$i]}" 'BEGIN { print a + b }')
    done
    printf '  %-34s %8ss\n' "total" "$total"
    for i in "${!FACTS[@]}"; do echo "  ${FACTS[$i]}"; done
    echo "  logs: $LOG_DIR"
}

cleanup() {
    local status=$?
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        local app
        app=$(server_process || true)
        [ -z "$app" ] || kill -TERM "$app" 2>/dev/null || true
        sleep 2
        kill -KILL "$SERVER_PID" 2>/dev/null || true
    fi
    if [ -n "$CONTAINER" ]; then
        "${BUILDAH[@]}" rm "$CONTAINER" >/dev/null 2>&1 || true
    fi
    if [ "$status" -ne 0 ] && [ -f "$LOG_DIR/server.log" ]; then
        echo "--- last lines of the server log ($LOG_DIR/server.log) ---" >&2
        tail -n 40 "$LOG_DIR/server.log" >&2
    fi
    summary "$status"
    exit "$status"
}
trap cleanup EXIT

remove_stale_containers() {
    # The storage under $CACHE_ROOT belongs to this script alone: any container in it was left
    # by an interrupted run (on vfs each one is a full copy of its image).
    "${BUILDAH[@]}" rm --all >/dev/null 2>&1 || true
}

check_prerequisites() {
    [ "$(id -u)" -eq 0 ] || die "run as root (debootstrap and buildah's vfs/chroot mode need it)"
    echo "storage driver: $STORAGE_DRIVER ($STORAGE_WHY)"
    local missing=()
    for tool in buildah debootstrap curl python3; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    [ ${#missing[@]} -eq 0 ] || die "missing tools: ${missing[*]} (apt-get install buildah debootstrap curl)"
    [ -f "$REPO_ROOT/Dockerfile" ] || die "no Dockerfile in $REPO_ROOT"
    [ -f "$REPO_ROOT/pyproject.toml" ] || die "no pyproject.toml in $REPO_ROOT: the image installs the package with 'pip install .'"
}

build_base_rootfs() {
    if [ -f "$BASE_DIR/rootfs.tar" ]; then
        echo "cached: $BASE_DIR/rootfs.tar"
        return
    fi
    local work
    rm -rf "$CACHE_ROOT/container-base/.build."*  # left by an interrupted run
    work=$(mktemp -d "$CACHE_ROOT/container-base/.build.XXXXXX")
    debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$work/rootfs" "$MIRROR" \
        >"$LOG_DIR/debootstrap.log" 2>&1 \
        || { tail -n 20 "$LOG_DIR/debootstrap.log" >&2; rm -rf "$work"; die "debootstrap failed"; }
    # Package caches and lists only bloat every image layer (each a full copy on vfs).
    rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"*
    tar --numeric-owner -C "$work/rootfs" -cf "$work/rootfs.tar" .
    mkdir -p "$BASE_DIR"
    mv "$work/rootfs.tar" "$BASE_DIR/rootfs.tar"
    rm -rf "$work"
}

import_base_image() {
    if "${BUILDAH[@]}" inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
        echo "cached: $BASE_IMAGE"
        return
    fi
    local ctr
    ctr=$("${BUILDAH[@]}" from scratch)
    "${BUILDAH[@]}" add "$ctr" "$BASE_DIR/rootfs.tar" / >/dev/null
    # The same defaults python:3.11-slim sets, so the Dockerfile behaves alike on both bases.
    "${BUILDAH[@]}" config --env LANG=C.UTF-8 \
        --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --cmd python3 --label "org.opencontainers.image.base.name=debian:$SUITE" "$ctr"
    "${BUILDAH[@]}" commit --rm "$ctr" "$BASE_IMAGE" >/dev/null
}

host_ca_bundle() {  # the CA bundle this machine's pip trusts (it may hold an egress proxy's CA)
    local cert="${PIP_CERT:-}"
    [ -n "$cert" ] || cert=$(python3 -m pip config get global.cert 2>/dev/null || true)
    [ -n "$cert" ] || cert=${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}
    echo "$cert"
}

build_image() {
    local args=(--layers --format docker --isolation chroot --pull=never
                --build-arg "BASE_IMAGE=$BASE_IMAGE" -t "$IMAGE")
    local cert index extra
    cert=$(host_ca_bundle)
    if [ -f "$cert" ]; then
        args+=(--volume "$cert:/run/host-ca.crt:ro" --build-arg PIP_CERT=/run/host-ca.crt)
    fi
    # Only network indexes can be mirrored into the build; file:// indexes exist on this host only.
    index=$(python3 -m pip config get global.index-url 2>/dev/null || true)
    case "$index" in http*) args+=(--build-arg "PIP_INDEX_URL=$index") ;; esac
    extra=$(python3 -m pip config get global.extra-index-url 2>/dev/null | tr ' ' '\n' | grep '^http' | tr '\n' ' ' || true)
    [ -z "${extra// /}" ] || args+=(--build-arg "PIP_EXTRA_INDEX_URL=${extra% }")
    # Even a fully cached buildah build costs minutes on vfs (it copies and deletes whole
    # rootfs trees), so an unchanged context, Dockerfile and build args skip it altogether.
    local key base_id stamp=$STAMP
    base_id=$("${BUILDAH[@]}" inspect --type image --format '{{.FromImageID}}' "$BASE_IMAGE")
    key=$(python3 "$SCRIPT_DIR/context_digest.py" "$REPO_ROOT" -- "$(cat "$REPO_ROOT/Dockerfile")" "$base_id" "${args[@]}")
    if [ -f "$stamp" ] && [ -s "$KERNEL_FLAGS" ] && [ "$(head -n 1 "$stamp")" = "$key" ] \
        && [ "$(tail -n 1 "$stamp")" = "$("${BUILDAH[@]}" inspect --type image --format '{{.FromImageID}}' "$IMAGE" 2>/dev/null)" ]; then
        echo "cached: $IMAGE (build context, Dockerfile and build args unchanged)"
        return
    fi
    rm -f "$stamp" "$KERNEL_FLAGS"
    "${BUILDAH[@]}" build "${args[@]}" -f "$REPO_ROOT/Dockerfile" "$REPO_ROOT" 2>&1 \
        | while IFS= read -r line; do printf '%(%T)T %s\n' -1 "$line"; done >"$LOG_DIR/build.log" \
        || { tail -n 30 "$LOG_DIR/build.log" >&2; die "image build failed (full log: $LOG_DIR/build.log)"; }
    prune_stale_images
    kernel_compile_lines >"$KERNEL_FLAGS"
    printf '%s\n%s\n' "$key" "$("${BUILDAH[@]}" inspect --type image --format '{{.FromImageID}}' "$IMAGE")" >"$stamp"
    "${BUILDAH[@]}" images --format '{{.Name}}:{{.Tag}} {{.Size}}' "$IMAGE"
}

kernel_compile_lines() {  # the compiler command of each native kernel, from the (pip -v) build log
    grep -oE '[^ ]*(gcc|g\+\+|c\+\+) .* -c kernels/cpu/csrc/[a-z0-9_]+\.cc .*' "$LOG_DIR/build.log" \
        || die "no kernel compile commands in the build log (pip install -v in the Dockerfile?)"
}

check_kernel_build() {
    # The kernels must be the portable build that picks its ISA at run time (setup.py: -O3, no
    # -march): an image built on one CPU runs on any x86-64 host.
    [ -s "$KERNEL_FLAGS" ] || die "no record of the kernel build ($KERNEL_FLAGS)"
    local want got
    want=$(cd "$REPO_ROOT" && ls kernels/cpu/csrc/*.cc | sort)
    got=$(grep -oE 'kernels/cpu/csrc/[a-z0-9_]+\.cc' "$KERNEL_FLAGS" | sort -u)
    [ "$want" = "$got" ] || die "kernel sources compiled: $(echo $got), expected: $(echo $want)"
    ! grep -q -- '-march=' "$KERNEL_FLAGS" || die "a kernel was compiled with -march: $(grep -o -- '-march=[^ ]*' "$KERNEL_FLAGS" | sort -u)"
    grep -q -- '-O3' "$KERNEL_FLAGS" || die "kernels not compiled with -O3"
    echo "kernels compiled without -march ($(echo "$got" | wc -l) sources): $(grep -oE -- '-O[0-3s]|-std=[^ ]+|-f[a-z-]+' "$KERNEL_FLAGS" | sort -u | tr '\n' ' ')"
}

prune_stale_images() {
    # On vfs every superseded image is a full rootfs copy. Keep the base and every step image of
    # this build (the builder stage's too, so the next build reuses its pip layer); drop the rest.
    local keep id removed=1
    keep=$( { grep -oE -- '--> (Using cache )?[0-9a-f]{11,}' "$LOG_DIR/build.log" | grep -oE '[0-9a-f]{11,}$'
              "${BUILDAH[@]}" inspect --type image --format '{{.FromImageID}}' "$BASE_IMAGE"; } | cut -c1-11 | sort -u)
    while [ "$removed" -gt 0 ]; do  # children first: a parent is removable once they are gone
        removed=0
        for id in $("${BUILDAH[@]}" images --all --noheading --format '{{.ID}}' | cut -c1-11 | sort -u); do
            grep -qx "$id" <<<"$keep" && continue
            "${BUILDAH[@]}" rmi "$id" >/dev/null 2>&1 && removed=$((removed + 1))
        done
    done
    echo "storage: $(du -sh "$CACHE_ROOT/container-storage-$STORAGE_DRIVER" | cut -f1)"
}

image_config() {  # image_config KEY: a field of the built image's Docker config, as JSON
    python3 -c 'import json, sys; print(json.dumps(json.load(open(sys.argv[1]))["Docker"]["config"].get(sys.argv[2])))' \
        "$LOG_DIR/image.json" "$1"
}

image_config_words() {  # image_config_words KEY: a list field, one word per line
    python3 -c 'import json, sys; [print(w) for w in json.loads(sys.argv[1]) or []]' "$(image_config "$1")"
}

check_image_config() {
    "${BUILDAH[@]}" inspect --type image "$IMAGE" >"$LOG_DIR/image.json"
    local entrypoint user healthcheck volumes ports
    entrypoint=$(image_config Entrypoint)
    user=$(image_config User)
    healthcheck=$(image_config Healthcheck)
    volumes=$(image_config Volumes)
    ports=$(image_config ExposedPorts)
    echo "entrypoint=$entrypoint user=$user volumes=$volumes ports=$ports"
    [ "$entrypoint" = '["slipstream", "serve", "--host", "0.0.0.0"]' ] || die "unexpected ENTRYPOINT $entrypoint"
    case "$user" in '""'|null|'"0"'|'"0:'*|'"root'*) die "image runs as root (USER=$user)" ;; esac
    [ "$healthcheck" != "null" ] || die "image has no HEALTHCHECK"
    echo "$ports" | grep -q '8000/tcp' || die "port 8000 not exposed"
    echo "$ports" | grep -q '9000/tcp' || die "port 9000 not exposed"
    [ "$volumes" != "null" ] || die "image declares no VOLUME for the compilation cache"
    local size
    size=$("${BUILDAH[@]}" images --format '{{.Size}}' "$IMAGE" | head -n 1)
    echo "image size: $size"
    FACTS+=("image size: $size")
}

# Runs inside the image as its default user (argv: the image's USER, the number of kernel sources):
# what an operator gets, checked from the outside rather than by reading the Dockerfile.
IMAGE_PROBE='
import glob, importlib.util, os, shutil, sys, sysconfig
user, sources = sys.argv[1].split(":")[0], int(sys.argv[2])
compilers = [c for c in ("gcc", "g++", "cc", "c++", "clang", "x86_64-linux-gnu-gcc") if shutil.which(c)]
test_packages = [m for m in ("pytest", "torch", "transformers", "hypothesis", "schemathesis", "grpc_tools")
                 if importlib.util.find_spec(m)]
kernels = sorted(os.path.basename(p) for p in glob.glob(sysconfig.get_paths()["purelib"] + "/slipstream/kernels/_*.so"))
venv = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(sys.prefix) for f in fs
           if not os.path.islink(os.path.join(d, f)))
print(f"uid {os.getuid()}; compilers {compilers}; test packages {test_packages}; kernels {kernels}; "
      f"venv {venv / 2**20:.0f} MiB")
problems = [text for bad, text in (
    (str(os.getuid()) != user or os.getuid() == 0, f"runs as uid {os.getuid()}, the image says USER {sys.argv[1]}"),
    (compilers, "compilers on PATH in the runtime image"),
    (test_packages, "test dependencies in the venv"),
    (len(kernels) != sources, f"{len(kernels)} native kernel modules, kernels/cpu/csrc has {sources} sources")) if bad]
sys.exit("; ".join(problems) if problems else 0)'

check_image_contents() {
    CONTAINER=$("${BUILDAH[@]}" from --pull=never "$IMAGE")
    local sources
    sources=$(cd "$REPO_ROOT" && ls kernels/cpu/csrc/*.cc | wc -l)
    "${BUILDAH[@]}" run --isolation chroot "$CONTAINER" -- \
        python3 -c "$IMAGE_PROBE" "$(image_config User | tr -d '"')" "$sources" >"$LOG_DIR/contents.log" 2>&1 \
        || { cat "$LOG_DIR/contents.log" >&2; die "the image's contents (above)"; }
    cat "$LOG_DIR/contents.log"
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start_server() {
    PORT=$(free_port)
    local user volume
    local -a entrypoint
    user=$(image_config User | tr -d '"')
    volume=$(python3 -c 'import json, sys; print(next(iter(json.loads(sys.argv[1]))))' "$(image_config Volumes)")
    mapfile -t entrypoint < <(image_config_words Entrypoint)
    # The volume outlives the container, like a named volume: a rerun reuses compiled programs.
    mkdir -p "$COMPILE_CACHE_DIR"
    chown "${user%%:*}" "$COMPILE_CACHE_DIR"
    READY_START=$EPOCHREALTIME
    # Port via env (as an operator would set it) so the HEALTHCHECK probes the same port; the
    # trailing --host keeps the server on loopback instead of the entrypoint's 0.0.0.0.
    "${BUILDAH[@]}" run --isolation chroot --network host --user "$user" \
        --volume "$COMPILE_CACHE_DIR:$volume" --env "SLIPSTREAM_PORT=$PORT" "$CONTAINER" -- \
        "${entrypoint[@]}" --host 127.0.0.1 "${SERVE_ARGS[@]}" \
        >"$LOG_DIR/server.log" 2>&1 &
    SERVER_PID=$!
    echo "server pid $SERVER_PID on 127.0.0.1:$PORT (log: $LOG_DIR/server.log)"
}

wait_ready() {
    local deadline=$((SECONDS + READY_TIMEOUT_S)) code
    while true; do
        kill -0 "$SERVER_PID" 2>/dev/null || die "server exited before becoming ready"
        code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/ready" || true)
        [ "$code" = 200 ] && break
        [ $SECONDS -lt $deadline ] || die "/ready not 200 after ${READY_TIMEOUT_S}s (last status $code)"
        sleep 2
    done
    code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/health")
    [ "$code" = 200 ] || die "/health answered $code"
    local app uid want
    app=$(server_process)
    [ -n "$app" ] || die "cannot find the slipstream process under buildah pid $SERVER_PID"
    uid=$(awk '/^Uid:/ { print $2 }' "/proc/$app/status")
    want=$(image_config User | tr -d '"')
    [ "$uid" = "${want%%:*}" ] || die "server runs as uid $uid, the image says USER $want"
    echo "serving as uid $uid"
    local ready_s
    ready_s=$(awk -v a="$READY_START" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
    echo "run -> /ready: ${ready_s}s"
    FACTS+=("run -> /ready: ${ready_s}s")
    # kernels.native logs which path each kernel takes; the ISA is chosen at run time
    ! grep -E 'native CPU kernel module .* is unavailable' "$LOG_DIR/server.log" >&2 \
        || die "a native kernel did not load in the image (server log above)"
    grep -oE 'kernel [a-z0-9_]+: native CPU \(.*\)' "$LOG_DIR/server.log" \
        || die "the server log names no native kernel"
}

run_healthcheck() {
    # Runs the image's own HEALTHCHECK command inside the container, as the runtime would.
    python3 - "$(image_config Healthcheck)" >"$LOG_DIR/healthcheck.args" <<'EOF'
import json, sys
test = json.loads(sys.argv[1])["Test"]
kind, args = test[0], test[1:]
if kind == "CMD-SHELL":
    args = ["/bin/sh", "-c", args[0]]
elif kind != "CMD":
    sys.exit(f"unsupported HEALTHCHECK form {kind}")
print("\0".join(args), end="")
EOF
    local -a hc
    mapfile -d '' hc <"$LOG_DIR/healthcheck.args"
    "${BUILDAH[@]}" run --isolation chroot --network host --env "SLIPSTREAM_PORT=$PORT" \
        "$CONTAINER" -- "${hc[@]}" >"$LOG_DIR/healthcheck.log" 2>&1 \
        || { cat "$LOG_DIR/healthcheck.log" >&2; die "HEALTHCHECK command failed"; }
}

streamed_completion() {
    local model
    model=$(curl -sS --max-time 30 "http://127.0.0.1:$PORT/v1/models" \
        | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])') \
        || die "GET /v1/models did not name the served model"
    curl -sS -N --max-time 300 -H 'Content-Type: application/json' \
        -d "{\"model\": \"$model\", \"prompt\": \"The capital of France is\", \"max_tokens\": 8, \"temperature\": 0, \"stream\": true}" \
        "http://127.0.0.1:$PORT/v1/completions" >"$LOG_DIR/completion.sse" \
        || die "completion request failed"
    python3 - "$LOG_DIR/completion.sse" <<'EOF'
import json, sys
events = [line[len("data: "):] for line in open(sys.argv[1]) if line.startswith("data: ")]
if not events or events[-1].strip() != "[DONE]":
    sys.exit(f"stream did not end with data: [DONE]: {events[-3:]}")
chunks = [json.loads(e) for e in events[:-1]]
text = "".join(c["choices"][0].get("text", "") for c in chunks)
if len(chunks) < 2 or not text.strip():
    sys.exit(f"expected several chunks with text, got {len(chunks)} chunks, text={text!r}")
print(f"{len(chunks)} SSE chunks, text={text!r}")
EOF
}

scrape_metrics() {
    curl -sS --max-time 30 "http://127.0.0.1:$PORT/metrics" >"$LOG_DIR/metrics.txt" || die "/metrics failed"
    python3 - "$LOG_DIR/metrics.txt" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
def value(pattern):
    m = re.search(rf"^{pattern}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, re.M)
    return None if m is None else float(m.group(1))
success = value(r"jetstream_request_success_count(?:_total)?")
ttft = value(r"jetstream_time_to_first_token_count")
for name in ("jetstream_prefill_backlog_size", "jetstream_slots_used_percentage", "slipstream_kv_pages_total"):
    if value(name) is None:
        sys.exit(f"/metrics has no {name}")
if not success or success < 1:
    sys.exit(f"jetstream_request_success_count is {success}, expected >= 1 after one completion")
if not ttft or ttft < 1:
    sys.exit(f"jetstream_time_to_first_token_count is {ttft}, expected >= 1")
print(f"success_count={success:g} ttft_count={ttft:g}")
EOF
}

server_process() {  # the containerised slipstream process under our `buildah run`
    local pid queue=("$SERVER_PID")
    while [ ${#queue[@]} -gt 0 ]; do
        pid=${queue[0]}
        queue=("${queue[@]:1}")
        if readlink "/proc/$pid/exe" 2>/dev/null | grep -q python \
            && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q 'slipstream serve'; then
            echo "$pid"
            return
        fi
        mapfile -t -O ${#queue[@]} queue < <(ps -o pid= --ppid "$pid" | tr -d ' ')
    done
}

stop_server() {
    # `buildah run` answers SIGTERM by killing its child outright, so signal the server itself,
    # as a container runtime signals PID 1.
    local app
    app=$(server_process)
    [ -n "$app" ] || die "cannot find the slipstream process under buildah pid $SERVER_PID"
    kill -TERM "$app"
    local deadline=$((SECONDS + 30)) status=0
    while kill -0 "$SERVER_PID" 2>/dev/null; do
        [ $SECONDS -lt $deadline ] || die "server still running 30s after SIGTERM (--shutdown-timeout 10)"
        sleep 0.5
    done
    wait "$SERVER_PID" || status=$?
    SERVER_PID=""
    [ "$status" -eq 0 ] || die "server exited with status $status after SIGTERM"
    # SLIPSTREAM_COMPILE_CACHE points into the VOLUME: compiled programs must have landed there.
    [ -n "$(ls -A "$COMPILE_CACHE_DIR")" ] || die "the compilation-cache volume is empty after a run"
}

mkdir -p "$CACHE_ROOT/container-base"
step "prerequisites" check_prerequisites
step "remove stale containers" remove_stale_containers
step "base rootfs (debootstrap $SUITE)" build_base_rootfs
step "import base image" import_base_image
step "build image" build_image
step "check image config" check_image_config
step "check kernel build flags" check_kernel_build
step "check image contents" check_image_contents
step "start container" start_server
step "wait for /ready" wait_ready
step "HEALTHCHECK inside container" run_healthcheck
step "streamed completion" streamed_completion
step "scrape /metrics" scrape_metrics
step "SIGTERM shutdown" stop_server
