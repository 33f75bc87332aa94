{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "encoderpool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: <release>-<chart>, or the release name when it already contains the chart name. */}}
{{- define "encoderpool.fullname" -}}
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

{{- define "encoderpool.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels: only name/instance/component, which never change after install. */}}
{{- define "encoderpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "encoderpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "encoderpool.labels" -}}
helm.sh/chart: {{ include "encoderpool.chart" . }}
{{ include "encoderpool.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: encoderpool
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "encoderpool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "encoderpool.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name: name an existing ServiceAccount when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "encoderpool.leaseName" -}}
{{- default (include "encoderpool.fullname" .) .Values.leaderElection.leaseName }}
{{- end }}

{{- define "encoderpool.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Is the operator cluster-wide? (Else it watches only the release namespace.) */}}
{{- define "encoderpool.clusterWide" -}}
{{- if eq .Values.scope "cluster" }}true{{ end }}
{{- end }}

{{/* The operator's ENCODERPOOL_METRICS_PORT: 0 (off) unless metrics.enabled. */}}
{{- define "encoderpool.metricsPort" -}}
{{- if .Values.metrics.enabled }}{{ int .Values.metrics.port }}{{ else }}0{{ end }}
{{- end }}

{{/* A Prometheus duration ("1m30s", "500ms") in milliseconds. */}}
{{- define "encoderpool.durationMs" -}}
{{- $ms := 0 }}
{{- range regexFindAll "[0-9]+(ms|h|m|s)" . -1 }}
{{- $n := int (regexFind "^[0-9]+" .) }}
{{- $unit := regexFind "[a-z]+$" . }}
{{- $ms = add $ms (mul $n (get (dict "h" 3600000 "m" 60000 "s" 1000 "ms" 1) $unit)) }}
{{- end }}
{{- $ms }}
{{- end }}
