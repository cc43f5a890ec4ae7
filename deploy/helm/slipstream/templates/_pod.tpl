{{/*
The server's pod template, shared by the Deployment and the multi-host modes. Called with
(dict "root" $ "role" ROLE), ROLE one of:
  single   one self-contained server (the Deployment)
  leader   process 0 of a LeaderWorkerSet group: HTTP/gRPC, the scheduler, the coordinator
  worker   process 1..N-1 of a LeaderWorkerSet group: runs the same steps, serves nothing
  indexed  any process of the Indexed Job: one template for all, so the probes ask for the index
Every process of a group gets the same engine settings: the steps only line up if they agree.
*/}}
{{- define "slipstream.podTemplate" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $v := $root.Values }}
{{- $multi := ne $role "single" }}
{{- $servesHttp := ne $role "worker" -}}
metadata:
  labels:
    {{- include "slipstream.selectorLabels" $root | nindent 4 }}
    {{- with $v.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- $scrape := and $v.metrics.podAnnotations $servesHttp }}
  {{- if or $scrape $v.podAnnotations }}
  annotations:
    {{- if $scrape }}
    prometheus.io/scrape: "true"
    prometheus.io/port: "8000"
    prometheus.io/path: /metrics
    {{- end }}
    {{- with $v.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
spec:
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if eq $role "indexed" }}
  # Pod i of an Indexed Job is named <job>-i; this subdomain gives it a DNS name.
  subdomain: {{ include "slipstream.hostsService" $root }}
  # A process restarts in place (keeping the emptyDir compile cache); the survivors exit
  # non-zero when a peer dies, so the whole group restarts and meets again at process 0.
  restartPolicy: OnFailure
  {{- end }}
  # The server drains in-flight requests for shutdownTimeout seconds after SIGTERM.
  terminationGracePeriodSeconds: {{ add $v.server.shutdownTimeout 5 }}
  securityContext:
    {{- toYaml $v.podSecurityContext | nindent 4 }}
  containers:
    - name: slipstream
      image: {{ include "slipstream.image" $root | quote }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      {{- with $v.server.extraArgs }}
      args:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      env:
        # The HEALTHCHECK and the probes below assume the server listens on 8000.
        - name: SLIPSTREAM_PORT
          value: "8000"
        - name: SLIPSTREAM_GRPC_PORT
          value: {{ ternary $v.grpc.port 0 $v.grpc.enabled | quote }}
        - name: SLIPSTREAM_MODEL
          value: {{ $v.model.name | quote }}
        - name: SLIPSTREAM_DTYPE
          value: {{ $v.server.dtype | quote }}
        - name: SLIPSTREAM_QUANTIZE
          value: {{ $v.server.quantize | quote }}
        - name: SLIPSTREAM_KV_CACHE_DTYPE
          value: {{ $v.server.kvCacheDtype | quote }}
        - name: SLIPSTREAM_MAX_SLOTS
          value: {{ $v.server.maxSlots | quote }}
        - name: SLIPSTREAM_MAX_SEQ_LEN
          value: {{ $v.server.maxSeqLen | quote }}
        - name: SLIPSTREAM_KV_CACHE_MEMORY
          value: {{ $v.server.kvCacheMemory | quote }}
        - name: SLIPSTREAM_MAX_QUEUE
          value: {{ $v.server.maxQueue | quote }}
        - name: SLIPSTREAM_SHUTDOWN_TIMEOUT
          value: {{ $v.server.shutdownTimeout | quote }}
        - name: SLIPSTREAM_COMPILE_CACHE
          value: /var/cache/slipstream
        {{- /* Left out at 1 (the server's default) so a single-host release renders as before. */}}
        {{- if or $multi (ne (int $v.server.tensorParallel) 1) }}
        - name: SLIPSTREAM_TENSOR_PARALLEL
          value: {{ $v.server.tensorParallel | quote }}
        {{- end }}
        {{- if or $multi (ne (int $v.server.dataParallel) 1) }}
        - name: SLIPSTREAM_DATA_PARALLEL
          value: {{ $v.server.dataParallel | quote }}
        {{- end }}
        {{- if $multi }}
        {{- include "slipstream.distributedEnv" (dict "root" $root "role" $role) | nindent 8 }}
        {{- end }}
        {{- if $v.apiKey.existingSecret }}
        # A file, not the key itself in the environment (which every child process inherits).
        - name: SLIPSTREAM_API_KEY_FILE
          value: /etc/slipstream/api-key/key
        {{- end }}
        {{- with $v.server.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- if $servesHttp }}
      ports:
        - name: http
          containerPort: 8000
          protocol: TCP
        {{- if $v.grpc.enabled }}
        - name: grpc
          containerPort: {{ $v.grpc.port }}
          protocol: TCP
        {{- end }}
        {{- if $multi }}
        - name: coordinator
          containerPort: {{ $v.multiHost.coordinatorPort }}
          protocol: TCP
        - name: control
          containerPort: {{ $v.multiHost.controlPort }}
          protocol: TCP
        {{- end }}
      {{- end }}
      {{- if eq $role "indexed" }}
      # Only process 0 serves HTTP; the other indexes pass these probes at once and are
      # watched through process 0 instead (a dead peer makes every process exit).
      startupProbe:
        {{- include "slipstream.processZeroProbe" "/ready" | nindent 8 }}
        periodSeconds: {{ $v.probes.startup.periodSeconds }}
        failureThreshold: {{ $v.probes.startup.failureThreshold }}
      readinessProbe:
        {{- include "slipstream.processZeroProbe" "/ready" | nindent 8 }}
        periodSeconds: {{ $v.probes.readiness.periodSeconds }}
        failureThreshold: {{ $v.probes.readiness.failureThreshold }}
      livenessProbe:
        {{- include "slipstream.processZeroProbe" "/health" | nindent 8 }}
        periodSeconds: {{ $v.probes.liveness.periodSeconds }}
        failureThreshold: {{ $v.probes.liveness.failureThreshold }}
      {{- else if $servesHttp }}
      # Start-up waits for /ready (model loaded and compiled); liveness stays on /health,
      # since a restart never helps a server that is merely busy.
      startupProbe:
        httpGet:
          path: /ready
          port: http
        periodSeconds: {{ $v.probes.startup.periodSeconds }}
        failureThreshold: {{ $v.probes.startup.failureThreshold }}
      readinessProbe:
        httpGet:
          path: /ready
          port: http
        periodSeconds: {{ $v.probes.readiness.periodSeconds }}
        failureThreshold: {{ $v.probes.readiness.failureThreshold }}
      livenessProbe:
        httpGet:
          path: /health
          port: http
        periodSeconds: {{ $v.probes.liveness.periodSeconds }}
        timeoutSeconds: {{ $v.probes.liveness.timeoutSeconds }}
        failureThreshold: {{ $v.probes.liveness.failureThreshold }}
      {{- end }}
      resources:
        {{- toYaml $v.resources | nindent 8 }}
      securityContext:
        {{- toYaml $v.securityContext | nindent 8 }}
      volumeMounts:
        - name: compile-cache
          mountPath: /var/cache/slipstream
        {{- if $v.model.volume }}
        - name: models
          mountPath: {{ $v.model.mountPath }}
          readOnly: true
        {{- end }}
        {{- if $v.apiKey.existingSecret }}
        - name: api-key
          mountPath: /etc/slipstream/api-key
          readOnly: true
        {{- end }}
  volumes:
    - name: compile-cache
      {{- toYaml $v.compileCache.volume | nindent 6 }}
    {{- if $v.model.volume }}
    - name: models
      {{- toYaml $v.model.volume | nindent 6 }}
    {{- end }}
    {{- if $v.apiKey.existingSecret }}
    - name: api-key
      secret:
        secretName: {{ $v.apiKey.existingSecret }}
        items:
          - key: {{ $v.apiKey.key }}
            path: key
    {{- end }}
  {{- with $v.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/*
jax.distributed's settings: where process 0's coordinator (and, on the same host, its lockstep
channel) listens, how many processes, and which one this is. LeaderWorkerSet's webhook puts LWS_* first in the env, so $(...) expands them; the
Job controller would append JOB_COMPLETION_INDEX after our entries, too late for $(...), so it is
defined here first, from the same annotation the controller uses.
*/}}
{{- define "slipstream.distributedEnv" -}}
{{- $v := .root.Values -}}
- name: SLIPSTREAM_NUM_PROCESSES
  value: {{ $v.multiHost.processes | quote }}
- name: SLIPSTREAM_CONTROL_PORT
  value: {{ $v.multiHost.controlPort | quote }}
{{- if eq .role "indexed" }}
- name: SLIPSTREAM_COORDINATOR_ADDRESS
  value: {{ printf "%s-0.%s.%s.svc:%v" (include "slipstream.fullname" .root) (include "slipstream.hostsService" .root) .root.Release.Namespace $v.multiHost.coordinatorPort | quote }}
- name: JOB_COMPLETION_INDEX
  valueFrom:
    fieldRef:
      fieldPath: metadata.annotations['batch.kubernetes.io/job-completion-index']
- name: SLIPSTREAM_PROCESS_ID
  value: "$(JOB_COMPLETION_INDEX)"
{{- else }}
- name: SLIPSTREAM_COORDINATOR_ADDRESS
  value: {{ printf "$(LWS_LEADER_ADDRESS):%v" $v.multiHost.coordinatorPort | quote }}
- name: SLIPSTREAM_PROCESS_ID
  value: "$(LWS_WORKER_INDEX)"
{{- end }}
{{- end }}

{{/*
An exec probe that checks PATH on process 0's HTTP server and passes on every other process.
*/}}
{{- define "slipstream.processZeroProbe" -}}
exec:
  command:
    - python3
    - -c
    - {{ printf "import os, urllib.request; os.environ['SLIPSTREAM_PROCESS_ID'] == '0' and urllib.request.urlopen('http://127.0.0.1:%%s%s' %% os.environ.get('SLIPSTREAM_PORT', '8000'), timeout=4)" . | quote }}
# Python's start-up alone can take a second on a busy node.
timeoutSeconds: 5
{{- end }}
