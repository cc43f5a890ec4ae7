{{/* Names and labels shared by every object of a release. */}}
{{- define "slipstream.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "slipstream.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "slipstream.selectorLabels" -}}
app.kubernetes.io/name: {{ include "slipstream.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "slipstream.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "slipstream.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "slipstream.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
Multi-host names. The LeaderWorkerSet controller makes a headless Service named after the
LeaderWorkerSet, so that name must differ from the chart's Service; LWS names StatefulSets and
pods after it, so it stays short.
*/}}
{{- define "slipstream.groupName" -}}
{{- printf "%s-group" (include "slipstream.fullname" . | trunc 40 | trimSuffix "-") }}
{{- end }}

{{- define "slipstream.hostsService" -}}
{{- printf "%s-hosts" (include "slipstream.fullname" . | trunc 56 | trimSuffix "-") }}
{{- end }}

{{/* The pod label that only process 0 of a group carries (set by LWS or the Job controller). */}}
{{- define "slipstream.processZeroLabel" -}}
{{- if eq .Values.multiHost.mode "leaderWorkerSet" -}}
leaderworkerset.sigs.k8s.io/worker-index: "0"
{{- else -}}
batch.kubernetes.io/job-completion-index: "0"
{{- end }}
{{- end }}

{{/* Settings a multi-host server cannot start with, refused before anything is applied. */}}
{{- define "slipstream.checkMultiHost" -}}
{{- $v := .Values }}
{{- if ne 1 (int $v.server.dataParallel) }}
{{- fail (printf "server.dataParallel is %d: a multi-host group serves one model replica over every process's devices; set it to 1 (or run one release per replica)" (int $v.server.dataParallel)) }}
{{- end }}
{{- $devices := int $v.server.tensorParallel }}
{{- if ne 0 (mod $devices (int $v.multiHost.processes)) }}
{{- fail (printf "server.tensorParallel (%d) spans every process's devices: make it a multiple of multiHost.processes (%d)" $devices (int $v.multiHost.processes)) }}
{{- end }}
{{- $taken := list 8000 }}
{{- if $v.grpc.enabled }}{{ $taken = append $taken (int $v.grpc.port) }}{{ end }}
{{- range $name := list "coordinatorPort" "controlPort" }}
{{- $port := int (get $v.multiHost $name) }}
{{- if has $port $taken }}
{{- fail (printf "multiHost.%s %d is taken: process 0 already listens on %v" $name $port $taken) }}
{{- end }}
{{- $taken = append $taken $port }}
{{- end }}
{{- end }}
