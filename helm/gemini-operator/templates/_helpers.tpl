{{/*
Names and labels shared by every template (the names Helm's own scaffold uses).
*/}}

{{/* The chart name, or nameOverride; 63 characters at most (a DNS label). */}}
{{- define "gemini-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The base name of every object: fullnameOverride, or "<release>-<chart>" (just the release name
when it already contains the chart name); capped at 63 characters because some Kubernetes name
fields are DNS labels.
*/}}
{{- define "gemini-operator.fullname" -}}
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

{{/* "<chart>-<version>" for the helm.sh/chart label ('+' is not allowed in label values). */}}
{{- define "gemini-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every object carries. */}}
{{- define "gemini-operator.labels" -}}
helm.sh/chart: {{ include "gemini-operator.chart" . }}
{{ include "gemini-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gemini-operator
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The labels that select the operator's pods; immutable once a Deployment exists. */}}
{{- define "gemini-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gemini-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
"<fullname>-<suffix>" for objects whose name must be a DNS label (Services): the base is cut so
the whole stays within 63 characters. Arguments: (list $ "metrics")
*/}}
{{- define "gemini-operator.suffixedName" -}}
{{- $root := index . 0 }}
{{- $suffix := index . 1 }}
{{- $base := include "gemini-operator.fullname" $root | trunc (int (sub 62 (len $suffix))) | trimSuffix "-" }}
{{- printf "%s-%s" $base $suffix }}
{{- end }}

{{/* The hint server's URL as worker pods reach it: failureHints.url, else the Service's. */}}
{{- define "gemini-operator.hintURL" -}}
{{- if .Values.failureHints.url }}
{{- .Values.failureHints.url }}
{{- else }}
{{- printf "http://%s.%s.svc:%d" (include "gemini-operator.suffixedName" (list $ "hints")) .Release.Namespace (int .Values.failureHints.port) }}
{{- end }}
{{- end }}

{{/* The ServiceAccount the operator runs as. */}}
{{- define "gemini-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "gemini-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false: name an existing ServiceAccount bound to the operator's RBAC" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* "repository:tag" (or "repository@digest"); the tag defaults to the chart's appVersion. */}}
{{- define "gemini-operator.imageRef" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository (default .appVersion .image.tag | toString) }}
{{- end }}
{{- end }}

{{/* The operator's image. */}}
{{- define "gemini-operator.image" -}}
{{- include "gemini-operator.imageRef" (dict "image" .Values.image "appVersion" .Chart.AppVersion) }}
{{- end }}

{{/* The default checkpoint sidecar image for GeminiJobs that do not name one. */}}
{{- define "gemini-operator.sidecarImage" -}}
{{- include "gemini-operator.imageRef" (dict "image" .Values.sidecarImage "appVersion" .Chart.AppVersion) }}
{{- end }}

{{/*
Refuse a monitoring.coreos.com object when the cluster does not serve its kind: installing it
would fail later with a less helpful "no matches for kind" error.
Arguments: (list $ "ServiceMonitor" "serviceMonitor")
*/}}
{{- define "gemini-operator.requirePrometheusOperator" -}}
{{- $root := index . 0 }}
{{- $kind := index . 1 }}
{{- $key := index . 2 }}
{{- if not ($root.Capabilities.APIVersions.Has (printf "monitoring.coreos.com/v1/%s" $kind)) }}
{{- fail (printf "%s.enabled is true, but this cluster does not serve monitoring.coreos.com/v1 %s: install the Prometheus Operator (or kube-prometheus-stack) CRDs first, or set %s.enabled=false and scrape the metrics Service yourself. With `helm template`, pass --api-versions monitoring.coreos.com/v1/%s." $key $kind $key $kind) }}
{{- end }}
{{- end }}

{{/* The PriorityClass of worker pods: priorityClasses.worker.name or "<fullname>-worker". */}}
{{- define "gemini-operator.workerPriorityClass" -}}
{{- default (include "gemini-operator.suffixedName" (list $ "worker")) .Values.priorityClasses.worker.name }}
{{- end }}

{{/* The PriorityClass of spare placeholder pods: priorityClasses.spare.name or "<fullname>-spare". */}}
{{- define "gemini-operator.sparePriorityClass" -}}
{{- default (include "gemini-operator.suffixedName" (list $ "spare")) .Values.priorityClasses.spare.name }}
{{- end }}

{{/* The operator pods' selector labels as "k=v,k=v" (--operator-pod-labels). */}}
{{- define "gemini-operator.operatorPodLabels" -}}
{{- $labels := include "gemini-operator.selectorLabels" . | fromYaml }}
{{- $pairs := list }}
{{- range $key := keys $labels | sortAlpha }}
{{- $pairs = append $pairs (printf "%s=%s" $key (get $labels $key)) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{/* The Secret holding the key job tokens are derived from (tokenKey.derive). */}}
{{- define "gemini-operator.tokenKeySecret" -}}
{{- include "gemini-operator.suffixedName" (list $ "token-key") }}
{{- end }}
