{{/* Names and labels shared by every object of the release. */}}

{{- define "memfit.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "memfit.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "memfit.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Selector labels of the operator pods (stable across upgrades: never add the version here). */}}
{{- define "memfit.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Labels of every object of the release. */}}
{{- define "memfit.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: memfit
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Labels of the operator's own objects (Deployment, its pods, Service, ...). */}}
{{- define "memfit.operatorLabels" -}}
{{ include "memfit.labels" . }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "memfit.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) -}}
{{- end -}}

{{- define "memfit.trainerImage" -}}
{{- printf "%s:%s" .Values.trainer.image.repository (default .Chart.AppVersion .Values.trainer.image.tag) -}}
{{- end -}}

{{- define "memfit.trainerCpuImage" -}}
{{- printf "%s:%s" .Values.trainer.cpuImage.repository (default (printf "%s-cpu" .Chart.AppVersion) .Values.trainer.cpuImage.tag) -}}
{{- end -}}

{{/* The Prometheus Operator's API is served: ServiceMonitor, PodMonitor, PrometheusRule can exist. */}}
{{- define "memfit.prometheusOperator" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" -}}true{{- end -}}
{{- end -}}

{{- define "memfit.serviceMonitor" -}}
{{- if and .Values.monitoring.serviceMonitor.enabled (include "memfit.prometheusOperator" .) -}}true{{- end -}}
{{- end -}}

{{/*
A NetworkPolicy namespaceSelector for one namespace (dict "ctx" $ "namespace" NAME): by the label every
namespace carries from Kubernetes 1.21 (kubernetes.io/metadata.name); before that, any namespace.
*/}}
{{- define "memfit.namespaceSelector" -}}
{{- if semverCompare ">=1.21-0" .ctx.Capabilities.KubeVersion.Version -}}
matchLabels:
  kubernetes.io/metadata.name: {{ .namespace }}
{{- else -}}
{}
{{- end -}}
{{- end -}}

{{/* The NetworkPolicy peers let into the trainer pods' metrics ports: the operator, and Prometheus. */}}
{{- define "memfit.metricsPeers" -}}
- namespaceSelector:
    {{- include "memfit.namespaceSelector" (dict "ctx" . "namespace" .Release.Namespace) | nindent 4 }}
  podSelector:
    matchLabels:
      {{- include "memfit.selectorLabels" . | nindent 6 }}
{{- with .Values.networkPolicy.prometheus }}
{{ toYaml . }}
{{- end }}
{{- end -}}
